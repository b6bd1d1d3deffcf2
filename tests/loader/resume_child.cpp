// Trains for two epochs on test::Noisy, logging each batch's values and saving the loader's state
// every 3 batches; with a state file present it resumes from it (truncating the log to the batches
// that state had seen). Killed by SIGKILL after `kill_after` batches of this run (-1: never).
// Run by tests/loader/test_resume.cpp: usage resume_child STATE LOG KILL_AFTER WORKERS
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "resume_common.h"

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const std::string state_path = argv[1], log_path = argv[2];
  const int kill_after = std::atoi(argv[3]);
  ferry::DataLoaderOptions o;
  o.batch_size = 8;
  o.shuffle = true;
  o.seed = 5;
  o.num_workers = std::atoi(argv[4]);
  ferry::DataLoader loader(ferry::test::Noisy{203}, o);
  if (std::filesystem::exists(state_path)) {
    std::ifstream in(state_path);
    std::stringstream text;
    text << in.rdbuf();
    loader.restore(ferry::LoaderState::from_string(text.str()));  // the log_bytes line is ignored here
    const std::string s = text.str();
    const auto at = s.find("log_bytes ");
    if (at == std::string::npos) return 3;
    std::filesystem::resize_file(log_path, std::stoull(s.substr(at + 10)));  // the lines after the state go
  }
  std::ofstream log(log_path, std::ios::app);
  int batches = 0;
  while (loader.next_epoch() < 2) {
    for (ferry::Tensor& b : loader) {
      for (std::int64_t k = 0; k < b.numel(); ++k) log << b.data<std::int64_t>()[k] << (k + 1 < b.numel() ? ' ' : '\n');
      log.flush();  // in the kernel's hands: a SIGKILL cannot lose it
      ++batches;
      if (batches % 3 == 0) {  // a checkpoint: the loader's state (and the log length it goes with)
        const std::string tmp = state_path + ".tmp";
        std::ofstream(tmp) << loader.state().to_string() << "log_bytes " << log.tellp() << "\n";
        std::filesystem::rename(tmp, state_path);
      }
      if (batches == kill_after) raise(SIGKILL);
    }
  }
  return 0;
}
