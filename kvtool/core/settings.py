"""Process-wide reading settings the CLI's root options set for every command (kept apart from
:mod:`kvtool.core.io` so that setting them imports nothing heavy)."""

from __future__ import annotations

# --no-verify-checksums turns this off (KVTOOL_NO_VERIFY_CHECKSUMS=1 too)
verify_checksums = True
# --allow-nonfinite turns this on (KVTOOL_ALLOW_NONFINITE=1 too)
allow_nonfinite = False
# one-off notes on stderr from the library (a CUDA extension being compiled); the CLI turns them
# off with -q and --json, whose stderr carries errors only
notes = True
