#!/usr/bin/env bash
# Installs the Debian packages the sandbox (cursor_rl/env/sandbox.py) and the CPU
# allocator need. Idempotent and silent when everything is present; run as root (CI runs as root).
#   bash launch/install_system_deps.sh
#
#   bwrap            bubblewrap: mount/PID/IPC/UTS namespaces and the read-only filesystem view
#   rg               ripgrep: the `search` tool's fast path (a pure-Python search is the fallback)
#   git              the fresh single-commit repository the agent sees
#   ip               iproute2: one network namespace per sandbox
#   nsenter setpriv prlimit   util-linux: join the namespace, drop to the sandbox user, rlimits
#   mount umount     the workspace's size-limited tmpfs
#   /usr/bin/python3 the interpreter graded tests use by default (GradeSpec.python)
#   libtcmalloc_minimal.so.4   tcmalloc, the allocator cursor_rl/main.py preloads on CPU
#                    (cursor_rl/host_malloc.py: glibc's speed settings without its memory growth)
set -euo pipefail

declare -A package_of=(
  [bwrap]=bubblewrap
  [rg]=ripgrep
  [git]=git
  [ip]=iproute2
  [nsenter]=util-linux
  [setpriv]=util-linux
  [prlimit]=util-linux
  [mount]=mount
  [umount]=mount
)

missing=()
for cmd in "${!package_of[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${package_of[$cmd]}")
done
[ -x /usr/bin/python3 ] || missing+=(python3)
compgen -G "/usr/lib*/libtcmalloc_minimal.so.4" >/dev/null \
  || compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null \
  || missing+=(libtcmalloc-minimal4)
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "install_system_deps.sh: need root to install: ${missing[*]}" >&2
  exit 1
fi
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "install_system_deps.sh: installing ${packages[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${packages[@]}"; } \
    >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
