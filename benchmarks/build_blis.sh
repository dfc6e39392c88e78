#!/usr/bin/env bash
# Build BLIS (github.com/inference-sim/inference-sim) offline, for benchmarks/bench_blis.py.
#
# Needs: a Go toolchain on PATH (or GO=/path/to/go), and a local git directory (a clone or
# bare mirror) of BLIS and of each Go module it imports; no module proxy is used. Each
# dependency is exported at a pinned revision into $SRC and wired in through go.mod
# `replace` directives; their own go.mod requirements are dropped, since main's go.mod
# already lists every module the binary needs.
#
# Usage: MIRRORS=/dir/with/owner+name/repo benchmarks/build_blis.sh [OUT_BINARY]   (default $SRC/inference-sim/blis)
#   MIRRORS  folder holding one git dir per repository, as $MIRRORS/<owner>+<name>/repo
#   SRC      where sources are exported (default /tmp/blis-src)
#   BLIS_REV BLIS revision (default HEAD of its mirror)
set -euo pipefail

MIRRORS=${MIRRORS:-/work/.mirror}
SRC=${SRC:-/tmp/blis-src}
BLIS_REV=${BLIS_REV:-HEAD}
OUT=${1:-$SRC/inference-sim/blis}  # beside defaults.yaml, where bench_blis.py looks
GO=${GO:-go}

# module path | mirror (owner+name) | revision (the version BLIS's go.mod pins, where tagged)
DEPS=(
  "github.com/google/uuid|google+uuid|v1.6.0"
  "github.com/sirupsen/logrus|sirupsen+logrus|v1.9.3"
  "github.com/spf13/cobra|spf13+cobra|v1.9.1"
  "github.com/spf13/pflag|spf13+pflag|v1.0.6"
  "github.com/inconshreveable/mousetrap|inconshreveable+mousetrap|v1.1.0"
  "github.com/stretchr/testify|stretchr+testify|v1.7.0"
  "github.com/davecgh/go-spew|davecgh+go-spew|v1.1.1"
  "github.com/pmezard/go-difflib|pmezard+go-difflib|v1.0.0"
  "gopkg.in/yaml.v3|go-yaml+yaml|v3.0.1"
  "golang.org/x/sys|golang+sys|c0bba94af5f8"
  "gonum.org/v1/gonum|gonum+gonum|HEAD"
)

export_tree() {  # export_tree <git dir> <revision> <destination>
  rm -rf "$3" && mkdir -p "$3"
  git --git-dir="$1" archive "$2" | tar -x -C "$3"
}

export_tree "$MIRRORS/inference-sim+inference-sim/repo" "$BLIS_REV" "$SRC/inference-sim"
REPLACES=""
for dep in "${DEPS[@]}"; do
  IFS='|' read -r module mirror rev <<<"$dep"
  dest="$SRC/deps/$mirror"
  export_tree "$MIRRORS/$mirror/repo" "$rev" "$dest"
  lang=$(sed -n 's/^go \([0-9.]*\).*/\1/p' "$dest/go.mod" 2>/dev/null | head -1 || true)
  printf 'module %s\n\ngo %s\n' "$module" "${lang:-1.16}" >"$dest/go.mod"   # its language version kept, requirements dropped
  rm -f "$dest/go.sum"
  REPLACES+="replace $module => $dest"$'\n'
done
printf '\n%s' "$REPLACES" >>"$SRC/inference-sim/go.mod"

cd "$SRC/inference-sim"
GOFLAGS=-mod=mod GOPROXY=off GOSUMDB=off GONOSUMCHECK=1 GOTOOLCHAIN=local GOWORK=off \
  "$GO" build -o "$OUT" main.go
echo "built $OUT ($(git --git-dir="$MIRRORS/inference-sim+inference-sim/repo" rev-parse --short "$BLIS_REV"))"
