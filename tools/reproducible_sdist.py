"""Rewrite an sdist so that one commit always gives the same bytes (``make dist``).

setuptools' wheel already honours ``SOURCE_DATE_EPOCH`` (every zip member's time); its sdist
does not: the files it writes (``PKG-INFO``, ``setup.cfg``, the ``.egg-info``) carry the time
of the build, the others the checkout's mtimes, and gzip's header the time of the build. So an
image's ``COPY`` of the sdist (or of a wheel built from it) would never hit the build cache.
This sets every member's time to ``SOURCE_DATE_EPOCH``, its owner to 0/0 with no names, keeps
the members' order, and writes gzip's header with that time and no file name.

    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) python tools/reproducible_sdist.py dist/*.tar.gz
"""

from __future__ import annotations

import gzip
import io
import os
import sys
import tarfile
from pathlib import Path


def normalize(path: Path, epoch: int) -> None:
    with tarfile.open(path, "r:gz") as src:
        members = [(m, src.extractfile(m).read() if m.isfile() else None) for m in src.getmembers()]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member, data in members:
            member.mtime = epoch
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            member.pax_headers = {}
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=epoch) as gz:
        gz.write(out.getvalue())
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    if not epoch.isdigit():
        print(f"reproducible_sdist: SOURCE_DATE_EPOCH must be whole seconds, got {epoch!r}", file=sys.stderr)
        return 2
    if not argv:
        print("reproducible_sdist: name the sdist(s) to rewrite", file=sys.stderr)
        return 2
    for name in argv:
        normalize(Path(name), int(epoch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
