#!/usr/bin/env bash
# Development helper for the lent-GPU workflow used to produce docs/benchmarks/: builds the tree that
# is carried to the GPU machine ($DEST, default /work/main/.gpu) from the bench branch with the kernel
# branches merged in a throw-away detached worktree (no branch is changed), plus uncommitted files of
# $SRC. Not needed to run `kvtool bench` on a machine of your own.
set -e
SRC=${SRC:-/work/wt/bench}
INTEG=${INTEG:-/tmp/integ}
BRANCHES=${BRANCHES:-"main bitmap evict retrieval export"}
git -C "$SRC" worktree remove --force "$INTEG" 2>/dev/null || rm -rf "$INTEG"
git -C "$SRC" worktree prune
git -C "$SRC" worktree add --detach "$INTEG" bench >/dev/null
cd "$INTEG"
for br in $BRANCHES; do
  git merge -q --no-edit "$br" >/dev/null 2>&1 || { echo "merge of $br conflicts: taking ours for conflicted files"; git checkout --ours . 2>/dev/null; git add -A; git commit -qm "merge $br (conflicts: ours)"; }
done
(cd "$SRC" && git ls-files -m -o --exclude-standard) | while read -r f; do mkdir -p "$(dirname "$INTEG/$f")"; cp "$SRC/$f" "$INTEG/$f"; done
DEST=${DEST:-/work/main/.gpu}
rm -rf "$DEST" && mkdir -p "$DEST"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$DEST"
echo "gpu tree: $(git log --oneline | head -1); $(du -sh "$DEST" | cut -f1)"; ls "$DEST/kvtool/kernels"
