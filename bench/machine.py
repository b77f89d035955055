"""What the CPU benchmarks record about the machine they ran on."""

import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else platform.processor(), else "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
