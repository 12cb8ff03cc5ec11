"""Figures as a person reads them in a log line."""


def duration(seconds: float) -> str:
    """`4m 05s`, `2h 13m`: an ETA's precision, no more."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def size(nbytes: float) -> str:
    """`312.4 KiB`, `1.2 TiB`: bytes as a person compares them."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
