#!/usr/bin/env bash
# Writes the README's compatibility table from the results of the compatibility corpus
# (tests/tests/corpus/: `cargo test -p stasis-tests --test corpus`, as root), which leaves one
# JSON line per program, start and mode in target/compat/*.jsonl. The table goes between the
# `compat-table` markers of README.md's "Compatibility" section; nothing else is changed.
#
# A cell is stasis's result over both starts (under `stasis run` and checkpointed by pid):
# ✓ restored, data checked, memory within the bound; ✗ with why otherwise; "refused" where
# stasis refuses the checkpoint up front (plain CRIU cannot restore it either).
# Usage: scripts/compat-table.sh [RESULTS_DIR]   (default target/compat)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
results=${1:-$root/target/compat}
readme=$root/README.md
shopt -s nullglob
files=("$results"/*.jsonl)
[ ${#files[@]} -gt 0 ] || { echo "compat-table: no results in $results (run the corpus tests first)" >&2; exit 1; }

table=$(cat "${files[@]}" | jq -s -r '
  def mib: . / 1024 * 10 | round / 10 | tostring;
  def cell($rows; $mode):
    [$rows[] | select(.mode == $mode and .start != "plain CRIU")] as $s
    | if ($s | length) == 0 then "not run"
      elif all($s[]; .result == "restored" and .pss_within_bound) then "✓"
      elif any($s[]; .result == "failed") then
        (if any($rows[]; .mode == $mode and .start == "plain CRIU" and .result == "restored")
         then "✗ fails (plain CRIU restores it)" else "✗ fails, not refused up front (plain CRIU fails too)" end)
      elif any($s[]; .result == "refused") then "refused"
      else "✗ memory" end;
  def plain($rows):
    [("eviction", "left running", "lazy") as $m
      | [$rows[] | select(.mode == $m and .start == "plain CRIU")][0]
      | select(. != null)
      | "\($m) \(if .result != "restored" then "✗" elif .pss_within_bound then "✓" else "✓ (memory x\(.held_after_kib / .held_before_kib * 100 | round / 100))" end)"]
    | if length == 0 then "" else "; plain CRIU: " + join(", ") end;
  def memory($rows):
    [$rows[] | select(.start != "plain CRIU" and .result == "restored")
      | "\(.mode) \(.held_before_kib | mib)→\(.held_after_kib | mib)"]
    | if length == 0 then "" else "; anonymous and shared PSS, MiB before→after (stasis run): " + join(", ") end;
  "| program | eviction | left running | lazy | notes |",
  "|---|---|---|---|---|",
  (group_by(.program)[] as $rows
    | "| \($rows[0].program) | \(cell($rows; "eviction")) | \(cell($rows; "left running")) | \(cell($rows; "lazy")) | \($rows[0].note)\(plain($rows))\(memory([$rows[] | select(.start == "stasis run")])) |")
')

awk -v table="$table" '
  /<!-- compat-table:start -->/ { print; print table; skip = 1; next }
  /<!-- compat-table:end -->/ { skip = 0 }
  !skip { print }
' "$readme" > "$readme.tmp"
grep -q '<!-- compat-table:start -->' "$readme.tmp" || { rm "$readme.tmp"; echo "compat-table: no markers in README.md" >&2; exit 1; }
mv "$readme.tmp" "$readme"
echo "compat-table: README.md's table made from ${#files[@]} result files" >&2
