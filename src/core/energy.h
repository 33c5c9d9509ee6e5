// Energy, power and clock of one NVIDIA GPU over a window of host time, read through NVML (the driver's management
// library, loaded at run time with dlopen: nothing to link, and a machine without it simply has no meter).
//
// Why: an H100 or H200 training BERT-large runs at its board power cap, so its throughput is the cap divided by the
// energy spent per sequence, and the SM clock it runs at inside a training step is lower than a kernel timed alone
// sees (docs/performance.md, 2026-11-26 evening). `nopad bench model` reports both beside the step time.
//
// Contract: EnergyMeter(pci_bus_id) finds the device by its PCI bus id (as cudaDeviceGetPCIBusId writes it);
// available() is false when NVML, the device or its energy counter is missing, and begin()/end() then do nothing and
// return an empty reading. Between begin() and end() a sampler thread reads the SM clock and the clock-event reasons
// every 10 ms; end() returns the joules the board's counter advanced by, the host seconds elapsed, the mean SM clock
// and the fraction of samples in which the software power cap held the clock down. Not thread-safe.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace nopad {

struct EnergyReading {
  bool valid = false;
  double joules = 0;        // energy counter delta (the whole board)
  double seconds = 0;       // host time between begin() and end()
  double sm_mhz = 0;        // mean of the samples
  double power_capped = 0;  // fraction of the samples with the software power cap active
  int samples = 0;
  double watts() const { return seconds > 0 ? joules / seconds : 0; }
};

// The arithmetic of a reading, apart from NVML (tested on the CPU): energy counter values in millijoules, the
// samples' clock sum and power-cap count.
EnergyReading make_energy_reading(uint64_t mj_begin, uint64_t mj_end, double seconds, double sm_mhz_sum,
                                  int capped_samples, int samples);

class EnergyMeter {
 public:
  explicit EnergyMeter(const std::string& pci_bus_id);
  ~EnergyMeter();
  EnergyMeter(const EnergyMeter&) = delete;
  EnergyMeter& operator=(const EnergyMeter&) = delete;

  bool available() const { return device_ != nullptr; }
  const std::string& why_unavailable() const { return why_; }
  void begin();
  EnergyReading end();

 private:
  void sample_loop();
  void* device_ = nullptr;  // nvmlDevice_t
  std::string why_;
  bool running_ = false;
  uint64_t mj_begin_ = 0;
  std::chrono::steady_clock::time_point t_begin_;
  std::atomic<bool> stop_{false};
  std::thread sampler_;
  double sm_mhz_sum_ = 0;  // written by the sampler, read after it is joined
  int capped_ = 0, samples_ = 0;
};

}  // namespace nopad
