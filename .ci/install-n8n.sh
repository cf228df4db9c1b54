#!/usr/bin/env bash
# Installs real n8n 1.123.81 (the last line that runs on Node 20) headless into DIR, for
# test/n8n-real.test.ts (LEASEHOLD_N8N_DIR=DIR). Reuses DIR when it already holds it. The same
# steps as the team's shared setup script; three things stand in the way, each worked around:
#  - n8n pulls xlsx from a CDN tarball: an npm override takes xlsx 0.18.5 from the registry;
#  - isolated-vm 6.x does not build on Node 20: install without scripts, then put 5.0.4 in its place;
#  - sqlite3's native module: rebuilt from source with node-gyp (needs python3, make, g++).
set -euo pipefail
dir=${1:?usage: install-n8n.sh DIR}
mkdir -p "$dir" && cd "$dir"
[[ -f package.json ]] || npm init -y >/dev/null
node -e "const f='package.json',p=require('./'+f);p.overrides={xlsx:'0.18.5'};require('fs').writeFileSync(f,JSON.stringify(p,null,2))"
[[ -d node_modules/n8n ]] || npm i -E --ignore-scripts n8n@1.123.81 >install.log 2>&1 || { tail -30 install.log >&2; exit 1; }
[[ -f node_modules/sqlite3/build/Release/node_sqlite3.node ]] || npm rebuild sqlite3 >rebuild.log 2>&1 || { tail -30 rebuild.log >&2; exit 1; }
if ! grep -q '"version": "5.0.4"' node_modules/isolated-vm/package.json; then
  rm -rf ivm5 && mkdir ivm5 && (cd ivm5 && npm init -y >/dev/null && npm i -E isolated-vm@5.0.4 >/dev/null 2>&1)
  rm -rf node_modules/isolated-vm && cp -r ivm5/node_modules/isolated-vm node_modules/isolated-vm
fi
echo "n8n $(N8N_USER_FOLDER="$dir/home" N8N_DIAGNOSTICS_ENABLED=false "$dir/node_modules/.bin/n8n" --version) installed in $dir"
