#!/usr/bin/env bash
# Build the tree the device tool carries (/work/main/.gpu): the bench branch with the kernel branches
# merged in a throw-away detached worktree (no branch is changed), plus uncommitted bench files.
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
rm -rf /work/main/.gpu && mkdir -p /work/main/.gpu
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C /work/main/.gpu
echo "gpu tree: $(git log --oneline | head -1); $(du -sh /work/main/.gpu | cut -f1)"; ls /work/main/.gpu/kvtool/kernels
