"""The process's memory, for the Python benchmarks: peak resident set (VmHWM) and its reset."""


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_kib():
    """The process's peak resident set since the last reset_peak(), KiB."""
    return _status_kib("VmHWM")


def rss_kib():
    """The process's resident set now, KiB."""
    return _status_kib("VmRSS")


def reset_peak():
    """Resets VmHWM to the current resident set (Linux: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
