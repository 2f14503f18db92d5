"""Is a torch version inside mp_wrappers' supported range? One line for tools/install.sh.

    python tools/torch_range.py 2.1.2+cu121      # exit 0: "supported" (or a warning line), 1: refused
    python tools/torch_range.py --installed      # the installed torch (exit 2 when none)

The range lives in mp_wrappers/compat.py (``TORCH_MIN``, ``TORCH_NEWEST_TESTED``), read here as text
so that this runs before anything is installed. Older than ``TORCH_MIN``: refused, with how to install
a supported one. Newer than the newest tested: accepted with a warning line (the build against it is
checked by tools/compat_matrix.sh's ``newest`` stack in CI).
"""
import os
import re
import sys
from typing import Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
COMPAT = os.path.join(HERE, '..', 'mp_wrappers', 'compat.py')
PINNED = '2.13.0'  # what tools/install.sh installs when no torch is there (MP_WRAPPERS_TORCH_VERSION)


def _version(text: str) -> Tuple[int, ...]:
    m = re.match(r'(\d+)\.(\d+)(?:\.(\d+))?', text)
    if not m:
        raise ValueError(f'cannot read a torch version from {text!r}')
    return tuple(int(g or 0) for g in m.groups())


def supported_range() -> Tuple[Tuple[int, ...], str]:
    """(TORCH_MIN, TORCH_NEWEST_TESTED) as written in mp_wrappers/compat.py."""
    with open(COMPAT) as f:
        text = f.read()
    low = re.search(r'^TORCH_MIN\b.*=\s*\((\d+),\s*(\d+)\)', text, re.M)
    newest = re.search(r"^TORCH_NEWEST_TESTED\s*=\s*'([^']+)'", text, re.M)
    if not (low and newest):
        raise RuntimeError(f'TORCH_MIN / TORCH_NEWEST_TESTED not found in {COMPAT}')
    return (int(low.group(1)), int(low.group(2))), newest.group(1)


def verdict(version: str) -> Tuple[int, str]:
    """(exit status, the one line) for torch ``version``."""
    low, newest = supported_range()
    low_text = '.'.join(map(str, low))
    found = _version(version)
    if found[:2] < low:
        return 1, (f'mp_wrappers install: torch {version} is not supported: mp_wrappers needs torch '
                   f'>= {low_text} (tested {low_text} to {newest}); install a supported one first, '
                   f'e.g. pip install "torch=={PINNED}" (or unset MP_WRAPPERS_TORCH_VERSION / '
                   f'uninstall torch and rerun tools/install.sh, which installs torch=={PINNED})')
    if found > _version(newest):
        return 0, (f'mp_wrappers install: warning: torch {version} is newer than the newest tested '
                   f'({newest}; supported: >= {low_text}); building against it anyway '
                   '(docs/compatibility.md)')
    return 0, f'mp_wrappers install: torch {version} is supported (>= {low_text}, tested up to {newest})'


def main(argv) -> int:
    if len(argv) != 1 or argv[0] in ('-h', '--help'):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == '--installed':
        try:
            import torch
        except ImportError:
            print('mp_wrappers install: no torch installed', file=sys.stderr)
            return 2
        version = torch.__version__
    else:
        version = argv[0]
    status, line = verdict(version)
    print(line, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
