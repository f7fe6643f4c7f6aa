#!/bin/sh
# kvserve container entrypoint.
#
#   (no arguments)                 kvserve serve on $KVSERVE_HOST:$KVSERVE_PORT (embedded model)
#   /models/NAME [flags]           kvserve serve /models/NAME [flags]
#   --config FILE.yaml [flags]     kvserve serve --config FILE.yaml [flags]
#   serve|generate|bench|kv-calc … that kvserve subcommand
#   any other program (sh, bash)   run it
#
# exec: kvserve becomes PID 1 and receives docker's SIGTERM itself (graceful drain), and its
# exit status is the container's: non-zero when the engine died, for `docker run --restart`.
# KVSERVE_API_KEY (read by kvserve) requires 'Authorization: Bearer KEY' on /v1/*; without it,
# kvserve on 0.0.0.0 logs a loud warning at start.
set -eu

HOST="${KVSERVE_HOST:-0.0.0.0}"
PORT="${KVSERVE_PORT:-8000}"

case "${1:-}" in
    serve)
        shift
        # Host/port first: flags given later on the command line override them.
        exec kvserve serve --host "$HOST" --port "$PORT" "$@"
        ;;
    generate|bench|kv-calc)
        exec kvserve "$@"
        ;;
    "" | -* | /* | ./*)
        exec kvserve serve --host "$HOST" --port "$PORT" "$@"
        ;;
    *)
        if command -v "$1" >/dev/null 2>&1; then
            exec "$@"
        fi
        # Anything else is a model name or relative path.
        exec kvserve serve --host "$HOST" --port "$PORT" "$@"
        ;;
esac
