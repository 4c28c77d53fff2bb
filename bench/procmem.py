"""The process's memory, for the Python benchmarks: peak resident set (VmHWM) and its reset."""


def peak_kib():
    """The process's peak resident set since the last reset_peak(), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def rss_kib():
    """The process's resident set now, KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def reset_peak():
    """Resets VmHWM to the current resident set (Linux: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
