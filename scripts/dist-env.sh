# Sourced by the multi-GPU scripts (gpu-tests-dist.sh, gpu-scale-out.sh): the launch environment of the GPU machine.
# mpirun may run as root there, NVLink multicast stays off (the machine's rule), and NCCL comes from the nvidia-nccl
# Python wheel when the system has none (CMake takes NCCL_ROOT as a hint). Builds go to build-gpu through
# scripts/setup.sh without its package install step (the GPU machine has no registry).
export NOPAD_SKIP_INSTALL=1 NOPAD_BUILD_DIR=build-gpu
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0
if [ -z "${NCCL_ROOT:-}" ] && [ ! -f /usr/include/nccl.h ] && [ ! -f /usr/local/cuda/include/nccl.h ]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null ||
              python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  export NCCL_ROOT
fi
