#!/bin/sh
# One pod of the bundled HA Redis (redis.ha, docs/deploy.md "Redis that survives a pod"): `redis` starts
# the server, as a replica of whichever pod the Sentinels name primary now (pod 0 when none answers: a fresh
# set), `sentinel` starts this pod's Sentinel watching that primary. Env: REDIS_PASSWORD, POD_NAME,
# HEADLESS (the headless Service's DNS suffix), SENTINEL_HOST (the Sentinels' Service), SET_NAME (the
# StatefulSet), QUORUM, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, MAXMEMORY.
set -eu
role="$1"
service=kvrelay
self="${POD_NAME}.${HEADLESS}"

ask_sentinels() {
  timeout 5 redis-cli -h "$SENTINEL_HOST" -p 26379 -a "$REDIS_PASSWORD" --no-auth-warning \
    sentinel get-master-addr-by-name "$service" 2>/dev/null | head -n 1 || true
}

primary="$(ask_sentinels)"
if [ -z "$primary" ]; then
  primary="${SET_NAME}-0.${HEADLESS}"
fi

if [ "$role" = redis ]; then
  set -- redis-server --port 6379 --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" \
    --replica-announce-ip "$self" --save "" --appendonly no \
    --maxmemory "$MAXMEMORY" --maxmemory-policy volatile-lru
  if [ "$primary" != "$self" ]; then
    set -- "$@" --replicaof "$primary" 6379
  fi
  exec "$@"
fi

# sentinel: wait until the primary's name resolves and it answers (the Sentinel refuses a name it cannot
# resolve), then write the config the Sentinel rewrites as it learns the others.
until timeout 5 redis-cli -h "$primary" -p 6379 -a "$REDIS_PASSWORD" --no-auth-warning ping \
    > /dev/null 2>&1; do
  sleep 1
  fresh="$(ask_sentinels)"
  if [ -n "$fresh" ]; then primary="$fresh"; fi
done
mkdir -p /data/sentinel
cat > /data/sentinel/sentinel.conf <<CONF
port 26379
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
exec redis-server /data/sentinel/sentinel.conf --sentinel
