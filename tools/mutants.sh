#!/usr/bin/env bash
# tools/mutants.sh FILE...: how strong the tests of each file are, by cargo-mutants: each file's
# mutants (a function's body replaced, an operator swapped, a condition negated) are built and
# run against the unit tests of the file's crate (`--lib`: no root, no cluster), and the file's
# caught / viable count is printed (viable: the mutants that build; missed ones are listed in
# mutants.out/missed.txt). It works in a copy of the tree with a target directory of its own, so
# the working tree's build is never overwritten. Installs cargo-mutants if the machine lacks it.
#
#   tools/mutants.sh crates/kubevol-core/src/migration.rs
#   tools/mutants.sh $(git ls-files 'crates/kubevol-core/src/*.rs')
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: tools/mutants.sh FILE..." >&2; exit 2; }
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants
work=${KUBEVOL_MUTANTS_DIR:-$(mktemp -d /tmp/kubevol-mutants.XXXXXX)}
mkdir -p "$work/results"
rm -rf "$work/tree"
mkdir -p "$work/tree"
git ls-files -z | xargs -0 cp --parents -t "$work/tree"
for file in "$@"; do
  crate=$(echo "$file" | sed -n 's|^crates/\([^/]*\)/.*|\1|p')
  [ -n "$crate" ] || { echo "$file: not a file of a crate of crates/" >&2; continue; }
  out="$work/results/$(echo "$file" | tr / _)"
  (cd "$work/tree" && CARGO_TARGET_DIR="$work/target" cargo mutants --no-shuffle -p "$crate" \
    -f "$file" --in-place --output "$out" -- --lib >/dev/null 2>&1) || true
  caught=$(wc -l <"$out/mutants.out/caught.txt" 2>/dev/null || echo 0)
  missed=$(wc -l <"$out/mutants.out/missed.txt" 2>/dev/null || echo 0)
  timeout=$(wc -l <"$out/mutants.out/timeout.txt" 2>/dev/null || echo 0)
  viable=$((caught + missed + timeout))
  if [ "$viable" -gt 0 ]; then
    pct=$(( (caught + timeout) * 1000 / viable ))
    printf '%-60s %4d / %-4d %3d.%d %%\n' "$file" $((caught + timeout)) "$viable" $((pct / 10)) $((pct % 10))
  else
    printf '%-60s no viable mutants\n' "$file"
  fi
  [ "$missed" -gt 0 ] && sed 's/^/    missed: /' "$out/mutants.out/missed.txt"
done
echo "(outputs in $work/results)"
