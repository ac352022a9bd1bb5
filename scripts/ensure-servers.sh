#!/usr/bin/env bash
# Makes sure the servers the integration tests start privately are
# installed: redis-server (origin tests) and mariadbd (propagation tests).
# As root on Debian or Ubuntu it installs what is missing; anywhere else it
# says what to install and fails.
set -euo pipefail

# mariadbd lives in /usr/sbin, which is not on every user's PATH.
PATH="$PATH:/usr/sbin:/usr/local/sbin"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v mariadbd >/dev/null 2>&1 || missing+=(mariadb-server)

if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
	echo "installing ${missing[*]} (needed by the tests)" >&2
	export DEBIAN_FRONTEND=noninteractive
	apt-get update
	apt-get install -y --no-install-recommends "${missing[@]}"
	exit 0
fi

cat >&2 <<MSG
The tests need these servers on PATH (they start private instances of them):
  redis-server   Redis 6 or later
  mariadbd       MariaDB 10.6 or later
Missing: ${missing[*]}
Install them, e.g.:
  Debian/Ubuntu:  sudo apt-get install -y redis-server mariadb-server
  macOS:          brew install redis mariadb
MSG
exit 1
