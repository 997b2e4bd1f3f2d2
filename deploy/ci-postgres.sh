#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the multi-driver study test (Debian's package,
# installed when missing). Prints the connection URL on stdout; everything else on stderr.
#
#   url=$(bash deploy/ci-postgres.sh start DIR)   ...   bash deploy/ci-postgres.sh stop DIR
#
# Needs root (to install the package and to run the server as the postgres user).
set -euo pipefail
cmd="${1:?start|stop}"; DIR="${2:?data folder}"
pgbin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
if [ "$cmd" = stop ]; then
  BIN="$(pgbin)"; [ -n "$BIN" ] && [ -d "$DIR/data" ] && \
    runuser -u postgres -- "$BIN/pg_ctl" -D "$DIR/data" -m fast stop >&2 || true
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "ci-postgres.sh: needs root" >&2; exit 3; }
if [ -z "$(pgbin)" ] || [ ! -x "$(pgbin)/postgres" ]; then
  echo "== installing PostgreSQL (Debian package)" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
BIN="$(pgbin)"
rm -rf "$DIR" && mkdir -p "$DIR" && chown postgres "$DIR"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
runuser -u postgres -- "$BIN/initdb" -D "$DIR/data" -A trust -U postgres >/dev/null
runuser -u postgres -- "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w \
  -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1" start >&2
runuser -u postgres -- "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres autotune
echo "postgresql+psycopg2://postgres@127.0.0.1:$PORT/autotune"
