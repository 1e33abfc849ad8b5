#!/bin/sh
# The one entrypoint of the splitserve images, for every role: the container's arguments are a
# `splitserve` command line.
#
#   docker run IMAGE gateway --host 0.0.0.0 --port 8000 --inbox-port 8001
#   docker run IMAGE instance --role prefill --gateway tcp://GATEWAY:8001 --host 0.0.0.0
#   docker run IMAGE instance --role decode  --gateway tcp://GATEWAY:8001 --host 0.0.0.0
#
# `exec` replaces this shell, so SIGTERM from the container runtime reaches splitserve itself
# (an instance drains what it holds on SIGTERM) and splitserve's exit status is the container's.
set -eu

if [ "$#" -eq 0 ]; then
    set -- --help
fi
exec splitserve "$@"
