#!/usr/bin/env bash
# Installs perf_analyzer 2.60 into a project-local folder with the glibc it needs.
# The PyPI wheel is built for glibc 2.38; Debian 12 has 2.36. Debian trixie's libc6,
# libstdc++6 and libgcc-s1 are fetched with a private sources list (nothing on the system
# changes) and unpacked with dpkg -x; `scripts/perf_analyzer` runs the binary through that
# loader.
set -euo pipefail
DEST=${1:-.pa-runtime}
PY=${PY:-.venv/bin/python}
[ -x "$DEST/lib/ld-linux-x86-64.so.2" ] && [ -x "$DEST/bin/perf_analyzer" ] && exit 0
rm -rf "$DEST" && mkdir -p "$DEST"/{apt/lists/partial,apt/archives,debs,root,lib,bin,wheel}
DEST=$(cd "$DEST" && pwd)
cat > "$DEST/apt/sources.list" <<SRC
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
SRC
APT_OPTS=(-o Dir::Etc::SourceList="$DEST/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State::Lists="$DEST/apt/lists" -o Dir::Cache::Archives="$DEST/apt/archives"
          -o APT::Architecture=amd64 -o Debug::NoLocking=1 -qq)
apt-get "${APT_OPTS[@]}" update
(cd "$DEST/debs" && apt-get "${APT_OPTS[@]}" download libc6 libstdc++6 libgcc-s1)
for deb in "$DEST"/debs/*.deb; do dpkg -x "$deb" "$DEST/root"; done
cp -a "$DEST"/root/usr/lib/x86_64-linux-gnu/. "$DEST/lib/"
cp -a "$DEST"/root/lib/x86_64-linux-gnu/. "$DEST/lib/" 2>/dev/null || true
cp -aL "$DEST"/root/usr/lib64/ld-linux-x86-64.so.2 "$DEST/lib/" 2>/dev/null || true

"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
  --python-version 3.11 -d "$DEST/wheel" perf-analyzer==2.60.0
"$PY" -m zipfile -e "$DEST"/wheel/perf_analyzer-*.whl "$DEST/wheel/x"
PA=$(find "$DEST/wheel/x" -type f -name perf_analyzer ! -name '*.py' | head -1)
cp "$PA" "$DEST/bin/perf_analyzer" && chmod +x "$DEST/bin/perf_analyzer"
rm -rf "$DEST/apt" "$DEST/debs" "$DEST/root" "$DEST/wheel"
"$DEST/lib/ld-linux-x86-64.so.2" --library-path "$DEST/lib" "$DEST/bin/perf_analyzer" --version
echo "perf_analyzer runtime ready in $DEST"
