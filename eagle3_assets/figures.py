"""Figures as a person reads them in a log line."""


def duration(seconds: float) -> str:
    """`4m 05s`, `2h 13m`: an ETA's precision, no more."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"
