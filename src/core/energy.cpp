// NVML through dlopen: the few entry points the meter uses, declared here with NVML's C types (a stable ABI), so the
// build needs no NVML headers or library and a machine without the driver just has no meter (energy.h).
#include "core/energy.h"

#include <dlfcn.h>

#include <mutex>

namespace nopad {

namespace {

using nvmlReturn_t = int;  // NVML_SUCCESS = 0
using nvmlDevice_t = void*;
constexpr int kNvmlClockSm = 1;                    // NVML_CLOCK_SM
constexpr unsigned long long kSwPowerCap = 0x4ull;  // nvmlClocksEventReasonSwPowerCap

struct Nvml {
  void* lib = nullptr;
  std::string error;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*energy)(nvmlDevice_t, unsigned long long*) = nullptr;
  nvmlReturn_t (*clock)(nvmlDevice_t, int, unsigned int*) = nullptr;
  nvmlReturn_t (*reasons)(nvmlDevice_t, unsigned long long*) = nullptr;
};

// Loaded and initialised once per process; never unloaded (NVML handles stay valid for the process).
const Nvml& nvml() {
  static Nvml n;
  static std::once_flag once;
  std::call_once(once, [] {
    n.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (n.lib == nullptr) {
      n.error = "libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)";
      return;
    }
    auto sym = [](const char* name) { return dlsym(n.lib, name); };
    n.init = reinterpret_cast<nvmlReturn_t (*)()>(sym("nvmlInit_v2"));
    n.by_pci = reinterpret_cast<nvmlReturn_t (*)(const char*, nvmlDevice_t*)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
    n.energy = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned long long*)>(
        sym("nvmlDeviceGetTotalEnergyConsumption"));
    n.clock = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, int, unsigned int*)>(sym("nvmlDeviceGetClockInfo"));
    void* r = sym("nvmlDeviceGetCurrentClocksEventReasons");  // the newer name; the older one where it is missing
    if (r == nullptr) r = sym("nvmlDeviceGetCurrentClocksThrottleReasons");
    n.reasons = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned long long*)>(r);
    if (!n.init || !n.by_pci || !n.energy || !n.clock) {
      n.error = "libnvidia-ml.so.1 lacks an entry point the meter needs";
      n.init = nullptr;
      return;
    }
    if (n.init() != 0) {
      n.error = "nvmlInit failed";
      n.init = nullptr;
    }
  });
  return n;
}

}  // namespace

EnergyReading make_energy_reading(uint64_t mj_begin, uint64_t mj_end, double seconds, double sm_mhz_sum,
                                  int capped_samples, int samples) {
  EnergyReading r;
  if (mj_end < mj_begin || !(seconds > 0)) return r;  // a counter that went back, or no time: no reading
  r.valid = true;
  r.joules = static_cast<double>(mj_end - mj_begin) / 1000.0;
  r.seconds = seconds;
  r.samples = samples;
  if (samples > 0) {
    r.sm_mhz = sm_mhz_sum / samples;
    r.power_capped = static_cast<double>(capped_samples) / samples;
  }
  return r;
}

EnergyMeter::EnergyMeter(const std::string& pci_bus_id) {
  const Nvml& n = nvml();
  if (n.init == nullptr) {
    why_ = n.error;
    return;
  }
  nvmlDevice_t dev = nullptr;
  unsigned long long mj = 0;
  if (n.by_pci(pci_bus_id.c_str(), &dev) != 0 || dev == nullptr) {
    why_ = "NVML has no device at PCI bus id " + pci_bus_id;
    return;
  }
  if (n.energy(dev, &mj) != 0) {
    why_ = "this GPU has no energy counter (NVML: not supported)";
    return;
  }
  device_ = dev;
}

EnergyMeter::~EnergyMeter() {
  if (running_) (void)end();
}

void EnergyMeter::sample_loop() {
  const Nvml& n = nvml();
  while (!stop_.load(std::memory_order_relaxed)) {
    unsigned int mhz = 0;
    unsigned long long reasons = 0;
    if (n.clock(device_, kNvmlClockSm, &mhz) == 0) {
      sm_mhz_sum_ += mhz;
      ++samples_;
      if (n.reasons != nullptr && n.reasons(device_, &reasons) == 0 && (reasons & kSwPowerCap) != 0) ++capped_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void EnergyMeter::begin() {
  if (!available() || running_) return;
  unsigned long long mj = 0;
  if (nvml().energy(device_, &mj) != 0) return;
  mj_begin_ = mj;
  sm_mhz_sum_ = 0;
  capped_ = samples_ = 0;
  stop_.store(false);
  t_begin_ = std::chrono::steady_clock::now();
  sampler_ = std::thread([this] { sample_loop(); });
  running_ = true;
}

EnergyReading EnergyMeter::end() {
  if (!running_) return {};
  running_ = false;
  unsigned long long mj = 0;
  const bool ok = nvml().energy(device_, &mj) == 0;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_begin_).count();
  stop_.store(true);
  sampler_.join();
  if (!ok) return {};
  return make_energy_reading(mj_begin_, mj, seconds, sm_mhz_sum_, capped_, samples_);
}

}  // namespace nopad
