"""A digest of the package's own source, so that a measurement names the code it ran.

Benchmarks run on lent GPU machines from a copy of the working tree whose git state may be stale, so the JSON of
`vllm-oscar bench` records this digest instead of trusting `git log` there. To find the commit of a result, compute
the digest of a checkout (``python -m vllm_oscar.provenance PATH/vllm_oscar``) and compare; `vllm-oscar env` prints
the digest of the installed package.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

#: File suffixes that make up the package's behaviour: its code and its shipped plan tables.
SOURCE_SUFFIXES = (".py", ".json")
#: Hex digits kept.
DIGEST_LENGTH = 12


def source_digest(package_dir: Path = Path(__file__).resolve().parent) -> str:
    """sha256 over the sorted relative paths and bytes of the SOURCE_SUFFIXES files under ``package_dir``
    (caches such as __pycache__ left out); the first DIGEST_LENGTH hex digits."""
    digest = hashlib.sha256()
    files = sorted(path for path in package_dir.rglob("*")
                   if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts)
    for path in files:
        digest.update(path.relative_to(package_dir).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:DIGEST_LENGTH]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    if not target.is_dir():
        sys.exit(f"{target} is not a directory: give the vllm_oscar folder of a checkout.")
    print(source_digest(target.resolve()))
