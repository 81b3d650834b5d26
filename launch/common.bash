# shellcheck shell=bash
# Helpers shared by the launch scripts (sourced, never run). The caller sets PROG and DRY_RUN.

# One argument, quoted so that a POSIX shell (or Python's shlex.split) reads it back unchanged.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# All arguments quoted and joined by spaces: a command line one can paste into a shell.
join_quoted() {
  local out="" arg
  for arg in "$@"; do out+="${out:+ }$(quote "$arg")"; done
  printf '%s' "$out"
}

# Print "+ command line" (the dry-run format).
show() { printf '+ %s\n' "$(join_quoted "$@")"; }

# Run a command (echoing it to stderr first), or under --dry-run only print it on stdout.
run() {
  if [[ $DRY_RUN == 1 ]]; then
    show "$@"
  else
    show "$@" >&2
    "$@"
  fi
}

# Bad command line: message, hint, exit status 2.
usage_error() {
  printf '%s: %s\nRun %s --help for usage.\n' "$PROG" "$1" "$PROG" >&2
  exit 2
}

# Called as `need_value "$@"` on a flag that takes a value: fail unless one follows it.
need_value() {
  if [[ $# -lt 2 || -z $2 || $2 == --* ]]; then usage_error "missing value for $1"; fi
}
