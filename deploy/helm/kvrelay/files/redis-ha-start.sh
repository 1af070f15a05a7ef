#!/bin/sh
# One pod of the bundled HA Redis (redis.ha, docs/deploy.md "Redis that survives a pod"). `redis` starts
# the server as a replica of the primary the Sentinels name; `sentinel` starts this pod's Sentinel watching
# it. Only a set whose Sentinels all fail to answer is fresh: its pod 0 starts primary. A pod the Sentinels
# still name primary (it restarted before they noticed) must not start primary again, empty, for its
# replicas to copy: it waits until they promote another. `prestop` hands the primary's role over first;
# `ready <port>` is the probes' check.
# Env: REDIS_PASSWORD, POD_NAME and HEADLESS (this pod's name is $POD_NAME.$HEADLESS, or SELF when set),
# SENTINELS (every pod's name, pod 0 first, space-separated), QUORUM, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS,
# MAXMEMORY; BIND (an address to listen on; unset: every one) and DATA_DIR (/data) for running it outside a
# pod (tests/deploy/test_redis_ha_script.py).
set -eu
role="$1"
service=kvrelay
self="${SELF:-${POD_NAME}.${HEADLESS}}"
data="${DATA_DIR:-/data}"
bind="${BIND:-}"

cli() {
  timeout 3 redis-cli -a "$REDIS_PASSWORD" --no-auth-warning "$@" 2>/dev/null || true
}

# The primary some Sentinel names (a pod of this set, nothing else: an error reply is not a name), or "".
ask_sentinels() {
  for sentinel in $SENTINELS; do
    answer="$(cli -h "$sentinel" -p 26379 sentinel get-master-addr-by-name "$service" | head -n 1)"
    case " $SENTINELS " in
      *" $answer "*) if [ -n "$answer" ]; then echo "$answer"; return; fi ;;
    esac
  done
}

# Whether any Sentinel answers at all (a fresh set has none).
sentinels_answer() {
  for sentinel in $SENTINELS; do
    if [ "$(cli -h "$sentinel" -p 26379 ping)" = PONG ]; then return 0; fi
  done
  return 1
}

if [ "$role" = ready ]; then  # the probes: PONG, not an error reply (LOADING, NOAUTH), on port $2
  [ "$(cli -h "$self" -p "$2" ping)" = PONG ]
  exit
fi

if [ "$role" = prestop ]; then
  if [ "$(cli -h "$self" -p 6379 role | head -n 1)" = master ] && [ "$(ask_sentinels)" = "$self" ]; then
    cli -h "$(echo $SENTINELS | cut -d ' ' -f 1)" -p 26379 sentinel failover "$service" > /dev/null
    for _ in $(seq 1 20); do
      if [ "$(ask_sentinels)" != "$self" ]; then break; fi
      sleep 1
    done
  fi
  exit 0
fi

primary="$(ask_sentinels)"
# redis: named primary, but about to start empty; either: Sentinels that answer without naming a primary
while { [ "$role" = redis ] && [ "$primary" = "$self" ]; } || { [ -z "$primary" ] && sentinels_answer; }; do
  sleep 1
  primary="$(ask_sentinels)"
done
if [ -z "$primary" ]; then
  primary="${SENTINELS%% *}"  # a fresh set: pod 0
fi

if [ "$role" = redis ]; then
  set -- redis-server --port 6379 --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" \
    --replica-announce-ip "$self" --save "" --appendonly no --dir "$data" \
    --maxmemory "$MAXMEMORY" --maxmemory-policy volatile-lru
  if [ -n "$bind" ]; then
    set -- "$@" --bind "$bind"
  fi
  if [ "$primary" != "$self" ]; then
    set -- "$@" --replicaof "$primary" 6379
  fi
  exec "$@"
fi

# sentinel: wait until the primary answers (the Sentinel refuses a name it cannot resolve), then write the
# config the Sentinel rewrites as it learns the others.
until [ "$(cli -h "$primary" -p 6379 ping)" = PONG ]; do
  sleep 1
  fresh="$(ask_sentinels)"
  if [ -n "$fresh" ]; then primary="$fresh"; fi
done
mkdir -p "$data/sentinel"
cat > "$data/sentinel/sentinel.conf" <<CONF
port 26379
${bind:+bind $bind}
dir ${data}/sentinel
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip ${self}
requirepass ${REDIS_PASSWORD}
sentinel sentinel-pass ${REDIS_PASSWORD}
sentinel monitor ${service} ${primary} 6379 ${QUORUM}
sentinel auth-pass ${service} ${REDIS_PASSWORD}
sentinel down-after-milliseconds ${service} ${DOWN_AFTER_MS}
sentinel failover-timeout ${service} ${FAILOVER_TIMEOUT_MS}
sentinel parallel-syncs ${service} 1
CONF
exec redis-server "$data/sentinel/sentinel.conf" --sentinel
