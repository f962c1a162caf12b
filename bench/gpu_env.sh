# Sourced by the GPU benches (gpu.sh, gpu_vectorized.sh, gpu_kernel_profile.sh)
# from the repository root: installs the Vulkan loader and glvnd from the
# .debs in .gl/ (NVIDIA's Vulkan ICD is libGLX_nvidia, which needs glvnd's
# libraries: libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2),
# points the loader at NVIDIA's ICD where the device image keeps it, unpacks
# .gpu/cohort.xz, and sets COHORT_DATA_DIR to .gpu/data.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
[ -f .gpu/cohort ] || xz -dk .gpu/cohort.xz
chmod +x .gpu/cohort
export COHORT_DATA_DIR="$PWD/.gpu/data"
