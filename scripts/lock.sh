#!/usr/bin/env bash
# `make lock`: resolve the newest releases pyproject.toml's ranges admit, in a throw-away venv, and write their
# exact versions (every transitive one included) to requirements.lock, the constraints `make install` uses.
set -euo pipefail
PYTHON=${PYTHON:-python3}
LOCK=${LOCK:-requirements.lock}
EXTRAS=${EXTRAS:-cpu,test,ray,cloud}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
echo "resolving .[$EXTRAS] in a fresh venv (a few minutes) ..."
"$tmp/venv/bin/pip" install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
"$tmp/venv/bin/pip" freeze --exclude-editable | LC_ALL=C sort -f > "$tmp/freeze"
# A pin must be installable by name from a package index: a line such as `name @ file:///...` is not.
if grep -v '==' "$tmp/freeze"; then
  echo "error: the packages above did not come from a package index; the lock cannot pin them" >&2
  exit 1
fi
py=$("$tmp/venv/bin/python" -c 'import platform, sys; print(f"CPython {sys.version_info[0]}.{sys.version_info[1]} on {platform.machine()} {platform.system()}")')
{
  echo "# The exact versions \`make install\` (and so make test, test-fast, demo, learns, ablation) installs, as pip"
  echo "# constraints: \`pip install -c requirements.lock -e '.[$EXTRAS]'\`. pyproject.toml keeps loose ranges for"
  echo "# people who install the library into an environment of their own."
  echo "# Resolved by \`make lock\` on $(date -u +%F) for $py. Run \`make lock\` again to take newer"
  echo "# releases on purpose (then \`make test\`), or when your Python cannot install one of these pins."
  cat "$tmp/freeze"
} > "$LOCK.tmp"
mv "$LOCK.tmp" "$LOCK"
echo "wrote $LOCK: $(grep -vc '^#' "$LOCK") pins (torch $(grep -i '^torch==' "$LOCK" | cut -d= -f3))"
