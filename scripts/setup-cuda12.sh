#!/usr/bin/env bash
# A CUDA 12 toolchain (nvcc 12.4.131) for the compiled variant's CUDA 12 build (torch-stable-abi210-cu124-...), on a
# clean Debian / Ubuntu x86_64 machine without NVIDIA's apt repository:
#
#   bash scripts/setup-cuda12.sh                   # installs into /opt/cuda-12.4 (CUDA12_PREFIX picks another)
#   NVCC=/opt/cuda-12.4/bin/nvcc .venv/bin/python -m kerneltools build --variant cuda-compiled
#
# It downloads Debian trixie's non-free nvidia-cuda-toolkit 12.4 packages with apt through a private apt state (the
# machine's own sources, package lists and installed packages stay as they are: nothing is installed system-wide),
# unpacks them, and lays out a CUDA_HOME-style prefix with its own nvcc.profile (bin/, include/, lib/, libdevice/).
# NVIDIA's binaries in those packages need glibc 2.28 or newer. nvcc 12.4 knows sm_50 to sm_90a (no sm_100 or
# sm_120: the library's sm_90 PTX serves those GPUs through the driver) and host compilers up to GCC 13.
set -euo pipefail
PREFIX=${CUDA12_PREFIX:-/opt/cuda-12.4}
WORK=${CUDA12_WORK:-$(mktemp -d /tmp/cuda12-setup.XXXXXX)}
PACKAGES="nvidia-cuda-toolkit nvidia-cuda-dev libnvvm4 libcudart12 libcu++-dev"

if [ -x "$PREFIX/bin/nvcc" ] && "$PREFIX/bin/nvcc" --version | grep -q "release 12.4"; then
  echo "CUDA 12.4 already at $PREFIX"
  exit 0
fi
command -v apt-get >/dev/null || { echo "error: apt-get not found: this script needs a Debian or Ubuntu machine" >&2; exit 1; }
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
if [ ! -f "$keyring" ]; then  # Ubuntu: Debian's archive key comes in this package
  apt-get install -y -q debian-archive-keyring
fi

mkdir -p "$WORK"/{lists/partial,cache/archives/partial,parts,prefs,debs,root}
echo "deb [signed-by=$keyring] http://deb.debian.org/debian trixie main contrib non-free" >"$WORK/sources.list"
touch "$WORK/status"
cat >"$WORK/apt.conf" <<EOF
Dir::Etc::sourcelist "$WORK/sources.list";
Dir::Etc::sourceparts "$WORK/parts";
Dir::Etc::preferencesparts "$WORK/prefs";
Dir::State::Lists "$WORK/lists";
Dir::Cache "$WORK/cache";
Dir::State::status "$WORK/status";
APT::Architecture "amd64";
EOF
export APT_CONFIG=$WORK/apt.conf
apt-get update -q
(cd "$WORK/debs" && apt-get download $PACKAGES)  # about 1 GB, nvidia-cuda-dev most of it
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/root"; done

R=$WORK/root/usr
mkdir -p "$PREFIX"/{bin,include,lib}
cp -a "$R/lib/nvidia-cuda-toolkit/bin/nvcc" "$R/lib/nvidia-cuda-toolkit/bin/cicc" "$R/lib/nvidia-cuda-toolkit/bin/crt" \
  "$PREFIX/bin/"
for tool in ptxas fatbinary nvlink cudafe++ cuobjdump nvdisasm nvprune bin2c cu++filt; do
  cp -a "$R/bin/$tool" "$PREFIX/bin/"
done
cp -a "$R/lib/nvidia-cuda-toolkit/libdevice" "$PREFIX/"
cp -a "$R/include/." "$PREFIX/include/"
cp -a "$R"/lib/x86_64-linux-gnu/libcudart* "$R"/lib/x86_64-linux-gnu/libcudadevrt.a "$R"/lib/x86_64-linux-gnu/libnvvm* \
  "$PREFIX/lib/"
# Debian's profile points at /usr; this one at the prefix (nvcc reads it beside itself).
cat >"$PREFIX/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/libdevice
LD_LIBRARY_PATH += $(TOP)/lib:
PATH            += $(TOP)/bin:
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
"$PREFIX/bin/nvcc" --version | tail -2
[ -n "${CUDA12_WORK:-}" ] || rm -rf "$WORK"
echo "CUDA 12.4 in $PREFIX: build with NVCC=$PREFIX/bin/nvcc"
