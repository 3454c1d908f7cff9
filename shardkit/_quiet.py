"""Start-up chatter of native libraries, dropped; every other line kept.

On a machine without a GPU, jaxlib's CUDA plugin logs "Could not find cuda drivers" from C++
(straight to file descriptor 2, each time one of its libraries loads, behind absl's "All log
messages before absl::InitializeLog()" preamble), and XLA:CPU's Gloo collectives print one
"[Gloo] Rank N is connected" line per communicator to stdout. No environment variable silences
them (``TF_CPP_MIN_LOG_LEVEL`` is not read by absl; ``JAX_PLATFORMS=cpu`` still loads the
plugin), so shardkit filters the text: while JAX is imported and while its plugins register
(``native_stderr_filtered``), and in ``shardkit launch``'s copy of its processes' output
(``without_chatter``). Only the exact lines below are dropped: warnings, errors and anything
else the libraries print go through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

_CHATTER = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\n"
    r"|^I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not "
    r"be used\.\n", re.M)
# Printed mid-line into whatever the process writes at that moment, so matched anywhere; a
# communicator short of its peers is news and stays.
_GLOO = re.compile(r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected "
                   r"peer ranks is : (\d+)\n")


# Two of a process's communicators connecting at once interleave their messages character by
# character ("[Gloo] Rank 1[Gloo] Rank  is connected to 11 is connected to ..."): a line made of
# nothing but the message's words, digits and punctuation is such a tangle, and goes too (its
# peer counts cannot be read back out of it).
_GLOO_WORDS = re.compile(r"\[Gloo\] Rank|is connected to|Expected number of connected|peer ranks is :|"
                         r"peer ranks\.|[\d\s.:]")


def _gloo_tangle(line: str) -> bool:
    # a whole, readable message left by _GLOO is one short of its peers: news, kept
    return (("[Gloo]" in line or line.startswith("Expected number of connected"))
            and not _GLOO.fullmatch(line) and not _GLOO_WORDS.sub("", line))


def without_chatter(text: str) -> str:
    """``text`` without the start-up lines above (whole lines; Gloo's also from inside a line,
    whose two halves are joined again, or tangled with another of its own messages)."""
    text = _GLOO.sub(lambda m: "" if m[1] == m[2] else m[0], text)
    text = "".join(line for line in text.splitlines(keepends=True) if not _gloo_tangle(line))
    return _CHATTER.sub("", text)


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Collects what is written to file descriptor 2 inside the block (C++ logging included) and
    writes it back to ``sys.stderr`` afterwards, without the chatter. Where descriptor 2 cannot
    be redirected (closed) or there is no ``sys.stderr``, the block runs unfiltered."""
    try:
        saved = os.dup(2) if sys.stderr is not None else None
    except OSError:
        saved = None
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = without_chatter(tmp.read().decode(errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def register_plugins() -> None:
    """Registers JAX's PJRT plugins now, as the backend's first use would, with their start-up
    chatter dropped (the CUDA plugin's library loads and logs as it registers). Call after the
    platforms are chosen: a plugin reads ``jax_platforms`` when it registers. A jax without this
    internal hook registers them when its backend starts, chatter included."""
    from jax._src import xla_bridge

    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None:
        with native_stderr_filtered():
            register()


with native_stderr_filtered():  # jaxlib loads the CUDA plugin's libraries as JAX is imported
    import jax  # noqa: E402, F401
