#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy 1.20.2 from Debian bookworm's
# `kubernetes` source package with Debian's Go, once, into a cache outside the repository, and the sandbox
# ("pause") binary from the same source. No registry ships these binaries, so this is the only way to get a real
# API server and node on a machine without Docker or downloads.
#
# Cache: $RLKUBE_CACHE (default ~/.cache/rlkube)/k8s-1.20.2/bin. Re-running with the binaries present is a no-op;
# with some missing (a cache from before one was added), only those are compiled.
set -euo pipefail
CACHE=${RLKUBE_CACHE:-$HOME/.cache/rlkube}
W="$CACHE/k8s-1.20.2"
BIN="$W/bin"
say() { printf '[control-plane build %(%H:%M:%S)T] %s\n' -1 "$*"; }

BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy pause)
missing() { for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || echo "$b"; done; }
cached() { [[ -z "$(missing)" ]]; }
if cached; then
  say "cached binaries found in $BIN"; exit 0
fi
# One build at a time per cache: two concurrent runs (parallel `make test`s, test sessions) would delete each
# other's source tree. A second run waits here, then finds the first one's binaries.
mkdir -p "$W"
exec 9>"$W/.build.lock"
if ! flock -n 9; then
  say "another build of this cache is running; waiting for it"
  flock 9
  if cached; then
    say "cached binaries found in $BIN"; exit 0
  fi
fi
mkdir -p "$W/apt/lists/partial" "$W/apt/cache/archives/partial"
cd "$W"
say "installing build inputs (golang-go, etcd, vendored-library replacements)"
URI=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || echo http://deb.debian.org/debian)
echo "deb-src $URI bookworm main" > apt/sources.list
APT_SRC=(-o "Dir::Etc::SourceList=$W/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
         -o "Dir::State::Lists=$W/apt/lists" -o "Dir::Cache=$W/apt/cache")
export DEBIAN_FRONTEND=noninteractive
INPUTS=(golang-go etcd-server rsync make dpkg-dev openssl gcc libc6-dev golang-github-modern-go-reflect2-dev
        golang-github-json-iterator-go-dev)
apt-get install -y -qq --no-install-recommends "${INPUTS[@]}" >/dev/null \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${INPUTS[@]}" >/dev/null; }
say "fetching the kubernetes source package"
apt-get "${APT_SRC[@]}" update -qq
rm -rf src && mkdir src && cd src
apt-get "${APT_SRC[@]}" source -qq kubernetes=1.20.5+really1.20.2-1.1+deb12u1 >/dev/null
cd kubernetes-1.20.5+really1.20.2
# The vendored reflect2 1.0.1 faults under Go >= 1.18 on the first custom-resource request
# ("fatal error: fault" in mapiterinit); Debian's packaged reflect2/json-iterator are fixed.
for d in github.com/modern-go/reflect2 github.com/json-iterator/go; do
  rm -rf "vendor/$d"; mkdir -p "vendor/$d"
  find "/usr/share/gocode/src/$d" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
    -exec cp -L {} "vendor/$d/" \;
done
export CGO_ENABLED=0 HOME="$W/home"; mkdir -p "$HOME"; unset GOFLAGS GO111MODULE
MISSING=($(missing))
WHAT=$(for b in "${MISSING[@]}"; do [[ $b == pause ]] || printf 'cmd/%s ' "$b"; done)
say "compiling ${MISSING[*]} (all of them: 10-12 minutes on 2 cores)"
if [[ -n $WHAT ]]; then
  make WHAT="$WHAT" >"$W/make.log" 2>&1 || { tail -30 "$W/make.log"; exit 1; }
fi
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"
[[ -d $BIN ]] && cp -a "$BIN/." "$BIN.tmp/"
for b in "${MISSING[@]}"; do
  if [[ $b == pause ]]; then
    # The pod sandbox's process: no registry serves the pause image here, so its C source is built, statically.
    gcc -Os -static -Wall -DVERSION=v3.4.1-rlkube -o "$BIN.tmp/pause" build/pause/linux/pause.c
  else
    cp "_output/bin/$b" "$BIN.tmp/"
  fi
done
rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
cd "$W" && rm -rf src home   # the source tree and Go build cache are ~2 GB; only the binaries are kept
say "built: $("$BIN/kube-apiserver" --version)"
