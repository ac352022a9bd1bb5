#!/usr/bin/env bash
# Makes sure the programs the tests and the load harness start privately are
# installed. Arguments name what to check (default: redis-server mariadbd
# curl, what `make test` needs: curl runs the README's admin examples; the
# harness adds wrk):
#
#   scripts/ensure-servers.sh                          # redis-server, mariadbd
#   scripts/ensure-servers.sh wrk redis-server mariadbd
#
# As root on Debian or Ubuntu it installs what is missing with apt-get;
# anywhere else it says what to install and fails.
set -euo pipefail

# mariadbd lives in /usr/sbin, which is not on every user's PATH.
PATH="$PATH:/usr/sbin:/usr/local/sbin"

want=("$@")
[ ${#want[@]} -gt 0 ] || want=(redis-server mariadbd curl)

missing=() # Debian package names
for prog in "${want[@]}"; do
	case $prog in
	redis-server) pkg=redis-server ;;
	mariadbd) pkg=mariadb-server ;;
	wrk) pkg=wrk ;;
	curl) pkg=curl ;;
	*)
		echo "ensure-servers: unknown program '$prog' (redis-server, mariadbd, wrk, curl)" >&2
		exit 2
		;;
	esac
	command -v "$prog" >/dev/null 2>&1 || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
	echo "installing ${missing[*]} with apt-get" >&2
	export DEBIAN_FRONTEND=noninteractive
	apt-get update
	apt-get install -y --no-install-recommends "${missing[@]}"
	exit 0
fi

cat >&2 <<MSG
These programs must be on PATH (private instances of them are started):
  redis-server   Redis 6 or later            (Debian/Ubuntu package redis-server)
  mariadbd       MariaDB 10.6 or later       (Debian/Ubuntu package mariadb-server)
  wrk            wrk 4.x with LuaJIT         (Debian/Ubuntu package wrk)
  curl           curl                        (Debian/Ubuntu package curl)
Missing packages: ${missing[*]}
Install them, e.g.:
  Debian/Ubuntu:  sudo apt-get install -y ${missing[*]}
  macOS:          brew install redis mariadb wrk
MSG
exit 1
