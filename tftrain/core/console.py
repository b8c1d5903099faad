"""What a run prints: phases with their times, figures with units, lines that fit 120
columns. TensorFlow-free (the plan's first lines come before TensorFlow loads)."""
from __future__ import annotations

import contextlib
import sys
import time

WIDTH = 120
PHASE_SECONDS: dict[str, float] = {}     # each phase's seconds, summed; a run clears it first


def say(text: str) -> None:
    """A line on stdout, flushed (a run's output is read as it comes: a log, a launcher's
    worker prefixes), wrapped at `WIDTH` columns (`wrap`)."""
    print(wrap(text), flush=True)


def warn(text: str) -> None:
    """`tftrain: warning: text`, wrapped like every line (`say`)."""
    say(f"tftrain: warning: {text}")


def wrap(text: str, width: int = WIDTH, indent: str = "    ") -> str:
    """`text` over as many lines of `width` columns as it needs, the ones after the first
    indented (words are not broken: a path longer than a line keeps its line)."""
    import textwrap

    if len(text) <= width:
        return text
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent,
                                   break_long_words=False, break_on_hyphens=False))


def problem(prefix: str, text: str) -> str:
    """A problem's lines as a command prints them: `prefix` once, on the first line; each
    further line of `text` (its own details) indented under it, every line then within
    `WIDTH` columns (`wrap`). A one-line problem stays one line, as scripts read it."""
    first, *rest = text.split("\n")
    if not rest:
        return f"{prefix}{first}"
    lines = [wrap(f"{prefix}{first}")]
    lines += [wrap("    " + line.lstrip(), indent="      ") for line in rest]
    return "\n".join(lines)


def listed(head: str, items: list[str], most: int = 8) -> str:
    """One problem of several parts: `head`, then an item a line (`problem` indents them
    under the prefix), at most `most` of them and a count of the rest. One item alone
    is `head` and it on one line."""
    if len(items) == 1:
        return f"{head} {items[0]}"
    shown = items if len(items) <= most else items[:most - 1]
    rest = [] if len(shown) == len(items) else [f"and {len(items) - len(shown)} more"]
    return "\n".join([head, *shown, *rest])


@contextlib.contextmanager
def phase(name: str, what: str = "", ended: bool = True):
    """`[name] what...` when the phase starts and `[name] done in T` when it ends (also
    when it fails: `[name] stopped after T`); yields a dict whose `"detail"` is printed
    after the time. `ended=False`: no line at its end, when what it made reports its time
    (the export preflight's line in the plan)."""
    say(f"[{name}] {what}..." if what else f"[{name}] ...")
    began = time.perf_counter()
    note: dict = {}
    try:
        yield note
    except BaseException:
        say(f"[{name}] stopped after {seconds(time.perf_counter() - began)}")
        raise
    detail = note.get("detail")
    took = time.perf_counter() - began
    PHASE_SECONDS[name] = PHASE_SECONDS.get(name, 0.0) + took
    if ended:
        say(f"[{name}] done in {seconds(took)}" + (f": {detail}" if detail else ""))


def seconds(s: float) -> str:
    """1.2 s, 42 s, 3 min 05 s, 1 h 02 min."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def size(n: float) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def rate(value: float, unit: str) -> str:
    """A rate with an SI prefix: 15.0k ex/s, 31.5 GFLOP/s."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.1f}{prefix} {unit}" if unit == "ex/s" else f"{scaled:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}" if value >= 10 else f"{value:.2g} {unit}"


def fit(text: str, width: int = WIDTH) -> str:
    """`text` cut to `width` columns (with an ellipsis)."""
    return text if len(text) <= width else text[:width - 1] + "…"


def is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
