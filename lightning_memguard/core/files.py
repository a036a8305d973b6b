"""Files written whole or not at all: a temporary file beside the final one, flushed, then renamed into place."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def written_atomically(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path beside ``path`` to write; on success it is flushed to disk and renamed to ``path``,
    on any failure removed, so ``path`` is never a half-written file (a killed process leaves only a hidden
    ``.<name>.<pid>.tmp``).

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> final = os.path.join(folder.name, "rows.csv")
        >>> with written_atomically(final) as temporary:
        ...     with open(temporary, "w", encoding="utf-8") as f:
        ...         _ = f.write("batch,ok\\n")
        >>> open(final, encoding="utf-8").read(), os.listdir(folder.name)
        ('batch,ok\\n', ['rows.csv'])
        >>> folder.cleanup()
    """
    final = os.fspath(path)
    folder, name = os.path.split(final)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        yield temporary
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
