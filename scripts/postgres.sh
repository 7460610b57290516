# Sourced by .ci/run (and by hand: `source scripts/postgres.sh && keel_pg_start`):
# a private PostgreSQL cluster for keel's tests, in a temporary directory,
# listening on a loopback port only, with password authentication and TLS.
# Installs Debian's PostgreSQL server when the machine lacks it. The
# database's address is exported as KEEL_TEST_POSTGRES_URL; keel_pg_stop
# stops the cluster and removes its directory (an EXIT trap calls it).
#
# TLS: a throwaway certificate authority signs the server's certificate
# (for localhost and 127.0.0.1) and a client certificate for the role
# keel_cert. The role keel_tls (same password as keel) may only connect
# encrypted, keel_cert only with its certificate. KEEL_TEST_POSTGRES_TLS_URL
# is keel_tls's address (host localhost, hostaddr 127.0.0.1) and
# KEEL_TEST_POSTGRES_TLS_DIR holds ca.crt, client.crt and client.key.

# The newest installed server's bin directory, or nothing. A machine with
# only the client (psql, which Debian puts in the same directory) counts as
# missing: the tests need initdb, pg_ctl and postgres. $1 is a root prefix
# (tests/install_checks.rs runs this on fake roots).
keel_pg_bindir() {
  local root="${1:-}" d
  for d in $(ls -d "$root"/usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ]; then
      echo "$d"
      return 0
    fi
  done
  return 1
}

keel_pg_install() {
  if keel_pg_bindir >/dev/null; then
    return 0
  fi
  echo "keel: installing PostgreSQL (the PostgreSQL store's tests run against a real server)" >&2
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq >&2
  # policy-rc.d keeps the package from starting the system's own cluster:
  # keel's tests start a private one.
  if [ "$(id -u)" = 0 ] && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    rm -f /usr/sbin/policy-rc.d
  else
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
  fi
  keel_pg_bindir >/dev/null || { echo "keel: PostgreSQL installed but no server binaries under /usr/lib/postgresql" >&2; return 1; }
}

# Writes the test certificates into $1 with openssl (which Debian's
# PostgreSQL package depends on): ca.crt, server.crt/key, client.crt/key.
keel_pg_make_certs() {
  local dir="$1"
  mkdir -p "$dir" || return 1
  (
    cd "$dir" || exit 1
    openssl req -x509 -newkey rsa:2048 -nodes -days 3 -subj "/CN=keel test CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout ca.key -out ca.crt || exit 1
    local who
    for who in server client; do
      local cn="localhost" ext="subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
      if [ "$who" = client ]; then
        cn="keel_cert"
        ext="extendedKeyUsage=clientAuth"
      fi
      openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" -keyout "$who.key" -out "$who.csr" || exit 1
      printf '%s\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n' "$ext" > "$who.ext"
      openssl x509 -req -in "$who.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3 \
        -extfile "$who.ext" -out "$who.crt" || exit 1
    done
    chmod 600 ./*.key
  ) >"$dir/openssl.log" 2>&1 || { cat "$dir/openssl.log" >&2; return 1; }
}

# Runs a server command as the cluster's owner (PostgreSQL refuses root).
keel_pg_as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

keel_pg_start() {
  keel_pg_install || return 1
  local bin
  bin="$(keel_pg_bindir)"
  KEEL_PG_DIR="$(mktemp -d /tmp/keel-pg.XXXXXX)"
  export KEEL_PG_DIR
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
    chown postgres "$KEEL_PG_DIR"
  fi
  local password="keel-test-$RANDOM$RANDOM"
  printf '%s\n' "$password" > "$KEEL_PG_DIR/pw"
  chmod 600 "$KEEL_PG_DIR/pw"
  [ "$(id -u)" = 0 ] && chown postgres "$KEEL_PG_DIR/pw"
  keel_pg_as_owner "$bin/initdb" -D "$KEEL_PG_DIR/data" -U keel --pwfile="$KEEL_PG_DIR/pw" \
    -A scram-sha-256 --no-instructions >"$KEEL_PG_DIR/initdb.log" 2>&1 \
    || { cat "$KEEL_PG_DIR/initdb.log" >&2; return 1; }
  local tls_options=""
  if command -v openssl >/dev/null && keel_pg_make_certs "$KEEL_PG_DIR/tls"; then
    # The server's copies of its key and the CA, owned by the server's user.
    cp "$KEEL_PG_DIR/tls/server.key" "$KEEL_PG_DIR/tls/server.crt" "$KEEL_PG_DIR/tls/ca.crt" "$KEEL_PG_DIR/data/"
    [ "$(id -u)" = 0 ] && chown postgres "$KEEL_PG_DIR/data/server.key" "$KEEL_PG_DIR/data/server.crt" "$KEEL_PG_DIR/data/ca.crt"
    chmod 600 "$KEEL_PG_DIR/data/server.key"
    # First match wins: these go before initdb's lines.
    local hba="$KEEL_PG_DIR/data/pg_hba.conf"
    { printf 'hostnossl all keel_tls all reject\nhostssl all keel_cert 127.0.0.1/32 cert\nhostnossl all keel_cert all reject\n'; cat "$hba"; } > "$hba.new"
    mv "$hba.new" "$hba"
    [ "$(id -u)" = 0 ] && chown postgres "$hba"
    tls_options=" -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c ssl_ca_file=ca.crt"
  else
    echo "keel: no openssl: the test PostgreSQL runs without TLS" >&2
  fi
  # Ports below the kernel's range for outgoing connections: a port in
  # that range can be handed to a client socket while the server is down
  # (keel_pg_restart), and the server could not take it back.
  local port tries=0 low high first=20000 last=32767
  read -r low high < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || { low=32768; high=60999; }
  if [ "$low" -gt 21000 ]; then
    last=$((low - 1))
  elif [ "$high" -lt 64000 ]; then
    first=$((high + 1)); last=65535
  fi
  while :; do
    port=$((first + RANDOM % (last - first + 1)))
    printf '%s\n' "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$KEEL_PG_DIR -c max_connections=300$tls_options" \
      > "$KEEL_PG_DIR/options"
    if keel_pg_as_owner "$bin/pg_ctl" -D "$KEEL_PG_DIR/data" -l "$KEEL_PG_DIR/server.log" -w -t 30 \
        -o "$(cat "$KEEL_PG_DIR/options")" start >/dev/null 2>&1; then
      break
    fi
    tries=$((tries + 1))
    if [ "$tries" -ge 5 ]; then
      echo "keel: the test PostgreSQL did not start; its log:" >&2
      cat "$KEEL_PG_DIR/server.log" >&2
      return 1
    fi
  done
  KEEL_PG_PORT="$port"
  export KEEL_PG_PORT
  PGPASSWORD="$password" keel_pg_as_owner "$bin/psql" -q -h 127.0.0.1 -p "$port" -U keel -d postgres \
    -c "create database keel_test" >/dev/null
  export KEEL_TEST_POSTGRES_URL="postgres://keel:$password@127.0.0.1:$port/keel_test"
  if [ -n "$tls_options" ]; then
    PGPASSWORD="$password" keel_pg_as_owner "$bin/psql" -q -h 127.0.0.1 -p "$port" -U keel -d keel_test \
      -c "create role keel_tls login password '$password'" -c "create role keel_cert login" \
      -c "grant create on database keel_test to keel_tls, keel_cert" >/dev/null || return 1
    export KEEL_TEST_POSTGRES_TLS_DIR="$KEEL_PG_DIR/tls"
    export KEEL_TEST_POSTGRES_TLS_URL="postgres://keel_tls:$password@localhost:$port/keel_test?hostaddr=127.0.0.1"
  fi
  trap keel_pg_stop EXIT
  echo "keel: test PostgreSQL on 127.0.0.1:$port ($KEEL_PG_DIR)" >&2
}

# Stops the cluster in $KEEL_PG_DIR (fast: connections are cut) and
# leaves it down, data kept; keel_pg_up starts it again on the same port.
keel_pg_down() {
  local bin
  bin="$(keel_pg_bindir)" || return 1
  keel_pg_as_owner "$bin/pg_ctl" -D "$KEEL_PG_DIR/data" -m fast -w stop >/dev/null
}

# Starts the cluster in $KEEL_PG_DIR again with its first options (same
# port). A start can fail while something still holds the port (a client
# socket the kernel gave that port to, say): it is tried again for a while.
keel_pg_up() {
  local bin tries=0
  bin="$(keel_pg_bindir)" || return 1
  until keel_pg_as_owner "$bin/pg_ctl" -D "$KEEL_PG_DIR/data" -l "$KEEL_PG_DIR/server.log" -w -t 30       -o "$(cat "$KEEL_PG_DIR/options")" start >/dev/null; do
    tries=$((tries + 1))
    if [ "$tries" -ge 10 ]; then
      echo "keel: the test PostgreSQL did not start again; its log:" >&2
      tail -n 20 "$KEEL_PG_DIR/server.log" >&2
      return 1
    fi
    sleep 1
  done
}

# Stops the cluster in $KEEL_PG_DIR, keeps it down for $1 seconds (default
# 2), and starts it again on the same port. tests/postgres_restart.rs
# restarts its own server under load with it.
keel_pg_restart() {
  keel_pg_down || return 1
  sleep "${1:-2}"
  keel_pg_up
}

keel_pg_stop() {
  if [ -n "${KEEL_PG_DIR:-}" ] && [ -d "$KEEL_PG_DIR/data" ]; then
    keel_pg_as_owner "$(keel_pg_bindir)/pg_ctl" -D "$KEEL_PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$KEEL_PG_DIR"
  fi
}

# A private cluster in a network namespace of its own, reached over a
# veth pair, so a test can cut the network between keel and the server
# (keel_pg_partition) the way a failed link does: packets vanish, nothing
# answers, no connection is reset. Needs root (namespaces) and iproute2
# (installed when missing). Exports KEEL_TEST_POSTGRES_URL (password
# authentication, no TLS), KEEL_PG_DIR, KEEL_PG_NETNS and KEEL_PG_VETH;
# keel_pg_stop_isolated (an EXIT trap) stops the server and removes the
# namespace.
keel_pg_start_isolated() {
  keel_pg_install || return 1
  if [ "$(id -u)" != 0 ]; then
    echo "keel: a partitioned server needs root (network namespaces)" >&2
    return 1
  fi
  if ! command -v ip >/dev/null; then
    echo "keel: installing iproute2 (a test cuts the network to its server)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >&2
  fi
  local bin tag net
  bin="$(keel_pg_bindir)"
  # The clean-up below removes $KEEL_PG_DIR: never one inherited from the
  # caller (the shared test server's).
  KEEL_PG_DIR=""
  tag="$$$RANDOM"
  tag="${tag:0:9}"
  KEEL_PG_NETNS="keelpg$tag"
  KEEL_PG_VETH="kn$tag"
  KEEL_PG_VETH_HOST="kh$tag"
  export KEEL_PG_DIR KEEL_PG_NETNS KEEL_PG_VETH KEEL_PG_VETH_HOST
  # A /30 in 10.200-249.x.y, chosen at random (another test's may exist).
  net="10.$((200 + RANDOM % 50)).$((RANDOM % 256)).$((4 * (RANDOM % 64)))"
  local host_ip="${net%.*}.$(( ${net##*.} + 1 ))" server_ip="${net%.*}.$(( ${net##*.} + 2 ))"
  ip netns add "$KEEL_PG_NETNS" || return 1
  trap keel_pg_stop_isolated EXIT
  ip link add "$KEEL_PG_VETH_HOST" type veth peer name "$KEEL_PG_VETH" || return 1
  ip link set "$KEEL_PG_VETH" netns "$KEEL_PG_NETNS" || return 1
  ip addr add "$host_ip/30" dev "$KEEL_PG_VETH_HOST" && ip link set "$KEEL_PG_VETH_HOST" up || return 1
  ip netns exec "$KEEL_PG_NETNS" ip addr add "$server_ip/30" dev "$KEEL_PG_VETH" || return 1
  ip netns exec "$KEEL_PG_NETNS" ip link set "$KEEL_PG_VETH" up || return 1
  ip netns exec "$KEEL_PG_NETNS" ip link set lo up || return 1
  KEEL_PG_DIR="$(mktemp -d /tmp/keel-pg.XXXXXX)"
  export KEEL_PG_DIR
  id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
  chown postgres "$KEEL_PG_DIR"
  local password="keel-test-$RANDOM$RANDOM"
  printf '%s\n' "$password" > "$KEEL_PG_DIR/pw"
  chmod 600 "$KEEL_PG_DIR/pw"
  chown postgres "$KEEL_PG_DIR/pw"
  keel_pg_as_owner "$bin/initdb" -D "$KEEL_PG_DIR/data" -U keel --pwfile="$KEEL_PG_DIR/pw" \
    -A scram-sha-256 --no-instructions >"$KEEL_PG_DIR/initdb.log" 2>&1 \
    || { cat "$KEEL_PG_DIR/initdb.log" >&2; return 1; }
  printf 'host all all %s/30 scram-sha-256\n' "$net" >> "$KEEL_PG_DIR/data/pg_hba.conf"
  # Its own namespace: the usual port is free there.
  printf '%s\n' "-c listen_addresses=$server_ip -c port=5432 -c unix_socket_directories=$KEEL_PG_DIR" \
    > "$KEEL_PG_DIR/options"
  ip netns exec "$KEEL_PG_NETNS" runuser -u postgres -- "$bin/pg_ctl" -D "$KEEL_PG_DIR/data" \
    -l "$KEEL_PG_DIR/server.log" -w -t 30 -o "$(cat "$KEEL_PG_DIR/options")" start >/dev/null \
    || { cat "$KEEL_PG_DIR/server.log" >&2; return 1; }
  PGPASSWORD="$password" ip netns exec "$KEEL_PG_NETNS" runuser -u postgres -- "$bin/psql" -q \
    -h "$server_ip" -p 5432 -U keel -d postgres -c "create database keel_test" >/dev/null || return 1
  export KEEL_TEST_POSTGRES_URL="postgres://keel:$password@$server_ip:5432/keel_test"
  echo "keel: partitionable test PostgreSQL on $server_ip:5432 (namespace $KEEL_PG_NETNS, $KEEL_PG_DIR)" >&2
}

# Cuts (`on`) or restores (`off`) the network between keel and the server
# keel_pg_start_isolated started: the server's end of the link goes down.
keel_pg_partition() {
  local state=up
  [ "${1:-on}" = on ] && state=down
  ip netns exec "$KEEL_PG_NETNS" ip link set "$KEEL_PG_VETH" "$state"
}

keel_pg_stop_isolated() {
  if [ -n "${KEEL_PG_NETNS:-}" ]; then
    if [ -n "${KEEL_PG_DIR:-}" ] && [ -d "$KEEL_PG_DIR/data" ]; then
      ip netns exec "$KEEL_PG_NETNS" runuser -u postgres -- "$(keel_pg_bindir)/pg_ctl" \
        -D "$KEEL_PG_DIR/data" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    # Removing the namespace removes the veth pair with it, unless its
    # end never moved there.
    ip netns del "$KEEL_PG_NETNS" 2>/dev/null || true
    ip link del "${KEEL_PG_VETH_HOST:-}" 2>/dev/null || true
  fi
  if [ -n "${KEEL_PG_DIR:-}" ]; then
    rm -rf "$KEEL_PG_DIR"
  fi
}
