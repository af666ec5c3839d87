#!/usr/bin/env bash
# Run mmrl on an existing Ray cluster (see README.md here): the controller joins it with
# trainer.ray_address=auto, and the workers spread over its nodes.
set -euo pipefail
if ! ray status >/dev/null 2>&1; then
    echo "no Ray cluster here: run 'ray start --head' on this machine and 'ray start --address=<head>:6379' on the others" >&2
    exit 1
fi
config=$1
shift
exec mmrl train "$config" trainer.ray_address=auto "$@"
