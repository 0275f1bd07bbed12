#!/usr/bin/env bash
# Build and push the moerl images (trainer, rollout, cpu) with docker buildx; `make images` runs this.
#
#   REGISTRY=123456789012.dkr.ecr.us-east-2.amazonaws.com/moerl make images
#
# Every version comes from images/versions.env and is passed as --build-arg. Settings (environment):
#   REGISTRY   where the images go; required. Images are $REGISTRY/moerl-<role>:$IMAGE_TAG.
#   IMAGE_TAG  default: `git describe --always --dirty` of this checkout.
#   ROLES      default: "trainer rollout cpu".
#   PLATFORM   default: linux/amd64 (p5en, p6-b200 and the CPU pools are x86_64).
#   PUSH       1 (default) pushes; 0 loads the image into the local engine instead.
#   DRY_RUN    1 prints the build commands and checks nothing else (no Docker engine needed).
#   CHECK_PINS 1 (default): before building the rollout image, check that SGLang's base image's own packages
#              accept moerl's requirements (images/check_pins.py: its pip list, then the Dockerfile's install
#              as a dry run inside it); with PUSH=0, `pip check` in the built image too. 0 skips both.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
versions_file="${repo_root}/images/versions.env"

fail() {
    echo "error: $*" >&2
    exit 2
}

# versions.env -> one --build-arg per line, in file order.
build_args=()
while IFS= read -r line || [[ -n "${line}" ]]; do
    [[ -z "${line}" || "${line}" == \#* ]] && continue
    [[ "${line}" =~ ^[A-Z][A-Z0-9_]*=[^[:space:]\"\']+$ ]] \
        || fail "images/versions.env: '${line}' is not NAME=VALUE (no spaces, no quotes); fix that line"
    build_args+=(--build-arg "${line}")
done <"${versions_file}"

[[ -n "${REGISTRY:-}" ]] \
    || fail "REGISTRY is not set; run e.g. 'make images REGISTRY=123456789012.dkr.ecr.us-east-2.amazonaws.com/moerl'"
tag="${IMAGE_TAG:-$(git -C "${repo_root}" describe --always --dirty 2>/dev/null || echo dev)}"
roles="${ROLES:-trainer rollout cpu}"
platform="${PLATFORM:-linux/amd64}"
if [[ "${PUSH:-1}" == "1" ]]; then output=--push; else output=--load; fi

if [[ "${DRY_RUN:-0}" != "1" ]]; then
    command -v docker >/dev/null 2>&1 \
        || fail "make images needs Docker with buildx and a running Docker engine; no 'docker' command here." \
                "Run it on a machine with Docker, or set DRY_RUN=1 to print the build commands"
    if ! engine_error="$(docker info 2>&1 >/dev/null)"; then
        fail "make images needs a running Docker engine and 'docker info' cannot reach one" \
             "(${engine_error//$'\n'/ }). This machine has the docker client but no engine: run it where" \
             "dockerd runs (or point DOCKER_HOST at a remote engine), or set DRY_RUN=1 to print the build commands"
    fi
    docker buildx version >/dev/null 2>&1 \
        || fail "make images needs the docker buildx plugin; install it (docker-buildx-plugin) and rerun"
fi

for role in ${roles}; do
    dockerfile="${repo_root}/images/${role}/Dockerfile"
    [[ -f "${dockerfile}" ]] || fail "ROLES: no image named '${role}'; choose from trainer, rollout, cpu"
    command=(docker buildx build --platform "${platform}" "${output}"
        --file "${dockerfile}" "${build_args[@]}"
        --tag "${REGISTRY}/moerl-${role}:${tag}" "${repo_root}")
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        printf '%q ' "${command[@]}"
        printf '\n'
    else
        check_pins=0
        [[ "${role}" == "rollout" && "${CHECK_PINS:-1}" == "1" ]] && check_pins=1
        if [[ "${check_pins}" == "1" ]]; then
            echo "checking the packages of SGLang's image against moerl's requirements (CHECK_PINS=0 skips)" >&2
            python3 "${repo_root}/images/check_pins.py" \
                || fail "images/check_pins.py: the rollout base image's packages do not accept moerl's (above)"
        fi
        echo "building ${REGISTRY}/moerl-${role}:${tag}" >&2
        "${command[@]}"
        if [[ "${check_pins}" == "1" && "${output}" == "--load" ]]; then
            python3 "${repo_root}/images/check_pins.py" --built "${REGISTRY}/moerl-${role}:${tag}" \
                || fail "images/check_pins.py: pip check fails in ${REGISTRY}/moerl-${role}:${tag} (above)"
        fi
    fi
done
