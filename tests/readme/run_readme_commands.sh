#!/usr/bin/env bash
# Runs, as written and from the repository root, every command the README shows in its ```sh
# blocks, except its two set-up commands (scripts/demo.sh and scripts/test.sh, which are what
# comes before: scripts/test.sh calls this last, once the build and .venv are there). Fails
# naming the first command that fails. Usage: run_readme_commands.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

mapfile -t commands < <(awk '/^```sh$/ { on = 1; next } /^```/ { on = 0 } on' README.md |
  sed 's/[[:space:]]*#.*$//' | grep -v '^[[:space:]]*$' |
  grep -v -E '^bash scripts/(demo|test)\.sh')
if ((${#commands[@]} == 0)); then
  echo "readme: no command found in README.md's sh blocks" >&2
  exit 1
fi
# A shell that sets nothing up: the commands must work as a new user types them.
for c in "${commands[@]}"; do
  echo "readme: \$ $c"
  if ! env -u ZEROSHARD_PYTHON -u VIRTUAL_ENV bash -c "$c" >/tmp/readme_command.$$ 2>&1; then
    cat /tmp/readme_command.$$ >&2
    rm -f /tmp/readme_command.$$
    echo "readme: this command of README.md failed: $c" >&2
    exit 1
  fi
done
rm -f /tmp/readme_command.$$
echo "readme: ${#commands[@]} commands of README.md ran"
