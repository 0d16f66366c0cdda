# `redis-server ARGS...` with protected mode off (as the official image builds it), bound to every
# interface; anything else runs as given.
if [ "$1" = "redis-server" ]; then
    shift
    exec redis-server --protected-mode no --bind '* -::*' "$@"
fi
exec "$@"
