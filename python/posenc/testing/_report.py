"""The result of a check: one Case per case run, and the Report that holds them (its
table, first failing case and diagnosis)."""

import zlib


class Case:
    """One case of a check: name, dtype, max_error (max |result - oracle|), tolerance, status
    ('pass', 'fail', 'error': the function raised or returned a wrong shape, 'unsupported': an
    optional case the function does not take), ok (False only for 'fail' and 'error'), seed (the
    case's own), message (the exception or shape problem) and inputs (the case's inputs, kept for
    failing cases)."""

    __slots__ = ("name", "dtype", "max_error", "tolerance", "status", "seed", "message",
                 "inputs", "info")

    def __init__(self, name, dtype, seed, max_error=float("nan"), tolerance=float("nan"),
                 status="pass", message="", inputs=None, info=None):
        self.name, self.dtype, self.seed = name, dtype, seed
        self.max_error, self.tolerance, self.status = max_error, tolerance, status
        self.message, self.inputs, self.info = message, inputs, info or {}

    @property
    def ok(self):
        return self.status in ("pass", "unsupported")

    @property
    def error(self):  # aliases
        return self.max_error

    max_err = error

    @property
    def tol(self):
        return self.tolerance

    def __iter__(self):  # name, max_error, tolerance: unpacks like a tuple
        return iter((self.name, self.max_error, self.tolerance))

    def __repr__(self):
        return (f"Case({self.name!r}, dtype={self.dtype}, max_error={self.max_error:.3g}, "
                f"tolerance={self.tolerance:.3g}, status={self.status!r})")


class Report:
    """The result of a check_*: ok (bool; also the report's truth value), cases (list of Case),
    diagnosis (list of sentences: the known mistakes the error pattern matches, then how to
    rerun the first failing case; empty when ok), notes (remarks that are no failure: cases the
    function does not support), first_failure (the first failing Case or None), seed, check (the
    function's name). str(report) is a table of the cases followed by the diagnosis."""

    def __init__(self, check, cases, diagnosis, notes, seed, call):
        self.check, self.cases, self.seed = check, cases, seed
        self.ok = all(c.ok for c in cases)
        self.first_failure = next((c for c in cases if not c.ok), None)
        self.diagnosis = [] if self.ok else list(diagnosis)
        self.notes = list(notes)
        if self.first_failure is not None:
            f = self.first_failure
            self.diagnosis.append(
                f"First failing case: '{f.name}' ({f.dtype}, case seed {f.seed}); rerun it alone "
                f"with {check}({call}, seed={seed}, cases=['{f.name}']); "
                "report.first_failure.inputs holds its inputs.")

    def __bool__(self):
        return self.ok

    def __str__(self):
        failed = sum(not c.ok for c in self.cases)
        head = (f"posenc.testing.{self.check}: " +
                ("ok" if self.ok else f"FAILED ({failed} of {len(self.cases)} cases)") +
                f", seed {self.seed}")
        w = max([len(c.name) for c in self.cases] + [4])
        lines = [head, f"  {'case':<{w}}  {'dtype':<8}  {'max error':>10}  {'tolerance':>10}"
                       "  status"]
        for c in self.cases:
            lines.append(f"  {c.name:<{w}}  {c.dtype:<8}  {c.max_error:>10.3g}  "
                         f"{c.tolerance:>10.3g}  {c.status}"
                         + (f": {c.message}" if c.message else ""))
        if self.diagnosis:
            lines.append("diagnosis:")
            lines += [f"  - {s}" for s in self.diagnosis]
        if self.notes:
            lines.append("notes:")
            lines += [f"  - {s}" for s in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _case_name(name, dt, dtype, dtypes):
    """A case's name: the dtype is appended unless the case runs in float32, or in the one
    dtype asked for."""
    if dt == "float32" or (dtype is not None and len(dtypes) == 1):
        return name
    return f"{name} [{dt}]"


def _case_seed(seed, name):
    return (int(seed) * 1000003 + zlib.crc32(name.encode())) % (2 ** 31)


def _errors_and_failing(results):
    """The diagnosis' first sentence for cases that raised (a list, maybe empty) and the failing
    cases."""
    out = []
    errors = [c for c in results if c.status == "error"]
    if errors:
        out.append(f"The function raised or returned a wrong shape in {len(errors)} case(s), first "
                   f"'{errors[0].name}': {errors[0].message}.")
    return out, [c for c in results if c.status == "fail"]
