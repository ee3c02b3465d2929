// diloco_model_dump: what the C++ trainer's model, corpus and data stream produce for one seed,
// so that examples/python/char_model_test.py can check the Python trainer's copy of them
// (examples/python/char_model.py) bit for bit. It builds the corpus and the LocalModel exactly
// as diloco_trainer does, runs a few inner steps of a group of one on the data stream of
// (--seed, --group-id, --group-rank), and prints one JSON object: the corpus hash, the seeds,
// the flat parameter vector's hash at the start and after the steps, every step's loss, and the
// eval loss. --out also writes both flat vectors as raw float32 (start, then end) for a diff.
// Thread-safety: a single-threaded program.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <xxhash.h>

#include <bit>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/flags.h"
#include "examples/diloco/corpus.h"
#include "examples/diloco/local_model.h"

namespace {

using namespace lk;
using namespace lk::diloco;

// XXH3-64 of the floats' bytes, 16 hex digits (the trainers' state hash).
std::string Hash(const std::vector<float>& v) {
  return fmt::format("{:016x}", XXH3_64bits(v.data(), v.size() * sizeof(float)));
}

struct DumpOptions {
  uint32_t seed = 1;
  std::string group_id = "g0";
  uint32_t group_rank = 0;
  uint32_t steps = 3;         // inner steps to run
  uint32_t eval_batches = 2;  // batches of the eval loss after the steps
  uint32_t corpus_bytes = 16384;
  std::string out;  // raw float32 file of the start and end vectors; empty: none
  ModelOptions model;
};

int Run(const DumpOptions& o) {
  torch::set_num_threads(1);  // as diloco_trainer: one thread keeps the reduction order
  const std::string text = MakeCorpus(o.corpus_bytes);
  Encoded data = Encode(text);
  std::unique_ptr<LocalModel> model = LocalModel::Create(o.model, o.seed, data);
  std::vector<float> start(model->numel()), end(model->numel());
  model->Flatten(start);
  // As the trainer: -0.0 becomes +0.0 in the initial weights.
  for (float& v : start) v = v + 0.0f;
  model->Load(start);
  const uint64_t group_key = std::hash<std::string>{}(o.group_id);
  const uint64_t data_seed = MixSeed({o.seed, group_key, o.group_rank});
  SplitMix rng(data_seed);
  // A group of one: the trainer's average is a sum over one trainer divided by one.
  GroupAverage average = [](std::span<float>) { return Status::Ok(); };
  std::vector<std::string> losses;
  for (uint32_t i = 0; i < o.steps; ++i) {
    Result<float> loss = model->InnerStep(rng, average);
    if (!loss.ok()) {
      std::fprintf(stderr, "diloco_model_dump: %s\n", loss.status().ToString().c_str());
      return 1;
    }
    losses.push_back(fmt::format("\"{:08x}\"", std::bit_cast<uint32_t>(*loss)));
  }
  model->Flatten(end);
  const uint64_t eval_seed = MixSeed({o.seed, 0x65766131});
  SplitMix eval_rng(eval_seed);
  const float eval = model->Eval(eval_rng, o.eval_batches);
  if (!o.out.empty()) {
    std::ofstream f(o.out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(start.data()), start.size() * sizeof(float));
    f.write(reinterpret_cast<const char*>(end.data()), end.size() * sizeof(float));
    if (!f) {
      std::fprintf(stderr, "diloco_model_dump: cannot write %s\n", o.out.c_str());
      return 1;
    }
  }
  // Floats as the hex of their bits, 64-bit values as decimal strings: JSON readers keep both
  // exactly.
  fmt::print(
      "{{\"corpus_hash\":\"{:016x}\",\"corpus_size\":{},\"vocab_size\":{},\"group_key\":\"{}\","
      "\"data_seed\":\"{}\",\"eval_seed\":\"{}\",\"params\":{},\"start_hash\":\"{}\","
      "\"end_hash\":\"{}\",\"losses\":[{}],\"eval_loss\":\"{:08x}\"}}\n",
      XXH3_64bits(text.data(), text.size()), text.size(), data.vocab.size(), group_key,
      data_seed, eval_seed, start.size(), Hash(start), Hash(end),
      fmt::join(losses, ","), std::bit_cast<uint32_t>(eval));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  DumpOptions o;
  Flags flags("diloco_model_dump",
              "Prints what diloco_trainer's model, corpus and data stream produce for one seed\n"
              "(a group of one, a few inner steps), for the Python trainer's parity test.");
  flags.Add("seed", &o.seed, "model initialisation and data order", "LK_DUMP_SEED");
  flags.Add("group-id", &o.group_id, "seeds the data stream", "LK_DUMP_GROUP_ID");
  flags.Add("group-rank", &o.group_rank, "seeds the data stream", "LK_DUMP_GROUP_RANK");
  flags.Add("steps", &o.steps, "inner steps to run", "LK_DUMP_STEPS");
  flags.Add("eval-batches", &o.eval_batches, "batches of the eval loss", "LK_DUMP_EVAL_BATCHES");
  flags.Add("corpus-bytes", &o.corpus_bytes, "size of the generated text", "LK_DUMP_CORPUS_BYTES");
  flags.Add("out", &o.out, "raw float32 file: the flat vector at the start, then at the end",
            "LK_DUMP_OUT");
  flags.Add("model-width", &o.model.width, "embedding width", "LK_DUMP_MODEL_WIDTH");
  flags.Add("layers", &o.model.layers, "transformer blocks", "LK_DUMP_LAYERS");
  flags.Add("heads", &o.model.heads, "attention heads", "LK_DUMP_HEADS");
  flags.Add("seq-len", &o.model.seq_len, "characters of context per sample", "LK_DUMP_SEQ_LEN");
  flags.Add("batch", &o.model.batch, "samples per inner step", "LK_DUMP_BATCH");
  flags.Add("inner-lr", &o.model.inner_lr, "AdamW learning rate", "LK_DUMP_INNER_LR");
  if (auto code = flags.ParseCommandLine(argc, argv, [&] { return o.model.Validate(); })) {
    return *code;
  }
  return Run(o);
}
