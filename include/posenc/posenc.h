// posenc/posenc.h - umbrella header: every public API of posenc.
#pragma once

#include "posenc/alibi.h"
#include "posenc/attention.h"
#include "posenc/check.h"
#include "posenc/config.h"
#include "posenc/deberta.h"
#include "posenc/error.h"
#include "posenc/io.h"
#include "posenc/learned.h"
#include "posenc/rope.h"
#include "posenc/scheme.h"
#include "posenc/shaw.h"
#include "posenc/sinusoidal.h"
#include "posenc/t5.h"
#include "posenc/tensor.h"
#include "posenc/version.h"
#include "posenc/xl.h"
