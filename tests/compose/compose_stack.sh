#!/usr/bin/env bash
# `make test-compose`: docker-compose.yml for real. Builds the image, starts the four services
# with `docker compose up`, trains the demo for a few steps through them with `turnrl run` from
# the host, checks the run's files on the host, and tears down.
#
# Needs root (it installs packages and may start dockerd). What it brings up it takes down:
# - the Docker engine: installed from Debian's packages (docker.io, docker-compose, debootstrap)
#   when missing; dockerd is started when none answers, and then stopped at the end, with the
#   iptables rules it added restored to what they were before (iptables-save/-restore);
# - the base image python:3.11-slim: pulled, or where no registry answers (our machines reach
#   only package registries), made with debootstrap from the host's Debian mirror;
# - egress: while the stack runs, DOCKER-USER drops anything a container sends anywhere but
#   another container (the image build uses the host's network, as pip on the host does);
# - the stack runs as its own compose project (turnrl-compose-test), its runs in a temp folder.
# Images stay in Docker's store, so a second run builds from cache.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/turnrl-compose-test.XXXXXX)
PROJECT=turnrl-compose-test
STEPS=3
export DEBIAN_FRONTEND=noninteractive
say() { echo "[compose-test $(date +%T)] $*"; }
fail() { say "FAILED: $*"; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root: it installs Docker and starts dockerd"

started_dockerd=0
dockerd_pid=""
torch_server_pid=""
egress_rules=()
compose=()
# dockerd adds chains and rules to the filter and nat tables, and sets FORWARD to DROP, and
# leaves them when it stops. iptables-restore puts back the tables the saved state holds; a
# table that did not exist before (a machine that never had a rule) is emptied instead.
restore_iptables() {
  local table chain
  for table in filter nat; do
    grep -q "^\*$table\$" "$WORK/iptables.before" && continue
    iptables -t "$table" -F && iptables -t "$table" -X
    for chain in $(iptables -t "$table" -S | awk '$1 == "-P" {print $2}'); do
      iptables -t "$table" -P "$chain" ACCEPT
    done
  done
  iptables-restore <"$WORK/iptables.before"
}
cleanup() {
  local status=$?
  set +e
  if [ ${#compose[@]} -gt 0 ]; then
    [ $status -ne 0 ] && "${compose[@]}" logs --no-color --tail 30
    "${compose[@]}" down --volumes --timeout 20 >/dev/null 2>&1
  fi
  for rule in "${egress_rules[@]}"; do iptables -D DOCKER-USER $rule; done
  [ -n "$torch_server_pid" ] && kill "$torch_server_pid"
  if [ $started_dockerd = 1 ]; then
    kill -TERM "$dockerd_pid"
    while kill -0 "$dockerd_pid" 2>/dev/null; do sleep 1; done
    restore_iptables
  fi
  rm -rf "$WORK"
  exit $status
}
trap cleanup EXIT

say "1. Docker engine"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null \
  || ! { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }; then
  apt-get update -qq
  apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  iptables-save >"$WORK/iptables.before"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  dockerd_pid=$!
  started_dockerd=1
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; fail "dockerd did not start"; }
fi
if docker compose version >/dev/null 2>&1; then compose_cmd=(docker compose); else compose_cmd=(docker-compose); fi
say "engine $(docker info --format '{{.ServerVersion}}'), ${compose_cmd[*]}"

say "2. base image python:3.11-slim"
if ! docker image inspect python:3.11-slim >/dev/null 2>&1 \
  && ! timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
  say "no registry answers: making it with debootstrap"
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  rootfs="$WORK/rootfs"
  debootstrap --variant=minbase \
    --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" \
    || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
  rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED  # the official image has no marker
  # The host's trusted CAs: pip in the build reaches the registry as pip on the host does.
  cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$rootfs/etc/ssl/certs/ca-certificates.crt"
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - python:3.11-slim >/dev/null
  rm -rf "$rootfs"
fi

say "3. image turnrl:cpu"
build_args=()
# torch's CPU wheel from the folder the host's pip finds it in, when there is one, served on
# loopback as an index (the build uses the host's network).
wheel=$(ls ${PIP_FIND_LINKS:-/nonexistent}/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
if [ -n "$wheel" ]; then
  mkdir -p "$WORK/torch-index/torch"
  ln -s "$wheel" "$WORK/torch-index/torch/"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 "$port" --directory "$WORK/torch-index" >/dev/null 2>&1 &
  torch_server_pid=$!
  build_args=(--build-arg "TORCH_INDEX_URL=http://127.0.0.1:$port/")
fi
docker build --network=host "${build_args[@]}" -t turnrl:cpu "$REPO" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; fail "docker build"; }

say "4. the python tool refuses to start in a default container (README: run it on the host)"
rc=0
out=$(timeout 120 docker run --rm turnrl:cpu serve tool 'tool.tools=[{class_name: python}]' 2>&1) || rc=$?
# It must exit, with an error naming the sandbox, not serve (timeout's 124) or crash otherwise.
[ $rc != 0 ] && [ $rc != 124 ] && grep -qi sandbox <<<"$out" \
  || { echo "$out" | tail -5; fail "a python tool service in a container exited with $rc"; }
say "$(grep -i sandbox <<<"$out" | tail -1)"

say "5. egress blocked for containers"
egress_rules=("-i docker0 ! -o docker0 -j DROP" "-i br-+ ! -o br-+ -j DROP")
for rule in "${egress_rules[@]}"; do iptables -I DOCKER-USER 1 $rule; done

say "6. docker compose up (the image's own user writes the runs)"
mkdir -p "$WORK/runs"
chown 10001:10001 "$WORK/runs"
export TURNRL_RUNS_DIR="$WORK/runs"
compose=("${compose_cmd[@]}" --project-name "$PROJECT" --file "$REPO/docker-compose.yml")
"${compose[@]}" up -d >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; fail "compose up"; }
for service in tool reward rollout trainer; do
  id=$("${compose[@]}" ps -q "$service")
  for _ in $(seq 60); do
    health=$(docker inspect -f '{{.State.Health.Status}}' "$id")
    [ "$health" = healthy ] && break
    sleep 2
  done
  [ "$health" = healthy ] || fail "$service is $health"
done
say "all four healthy"

say "7. turnrl run against the composed trainer ($STEPS steps)"
"$REPO/.venv/bin/turnrl" run --config "$REPO/examples/calculator/config.yaml" \
  trainer_service.address=127.0.0.1:50054 \
  trainer.rollout_service.address=rollout:50053 \
  trainer.weight_sync.master_address=trainer \
  trainer.run_name=compose-check trainer.steps=$STEPS trainer.eval_every=$STEPS \
  || fail "turnrl run"
# Weights went to the rollout container over the gloo group, not the gRPC fallback.
if "${compose[@]}" logs --no-color trainer | grep "no weight-sync group"; then
  fail "the trainer and the rollout container formed no weight-sync group"
fi
run_dir="$WORK/runs/compose-check"
for file in summary.json curves.png metrics.jsonl final_model/model.safetensors; do
  [ -s "$run_dir/$file" ] || fail "no $file in the run folder on the host"
done
python3 - "$run_dir/summary.json" "$STEPS" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
print("summary:", json.dumps(summary))
assert summary["steps"] == int(sys.argv[2]), "the run did not take its steps"
# The rollout container serves exactly the trainer's weights: the same shipped model at the
# start, every push after.
assert summary["logprob_mismatch_mean_abs"] < 1e-4, "engine and trainer disagree"
EOF
say "passed"
