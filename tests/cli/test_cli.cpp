// The kvlab binary as a user runs it: exit codes, messages, outputs.
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.hpp"

namespace kvlab {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  std::string stdout_only;
};

RunResult run(const std::string& arguments) {
  test::TempDir dir;
  const std::string command = std::string(KVLAB_BINARY) + " " + arguments + " > " +
                              (dir / "out").string() + " 2> " + (dir / "err").string();
  const int status = std::system(command.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.stdout_only = test::read_file(dir / "out");
  r.output = r.stdout_only + test::read_file(dir / "err");
  return r;
}

void expect_failure(const std::string& arguments, const std::string& message_part) {
  const RunResult r = run(arguments);
  EXPECT_NE(r.exit_code, 0) << arguments;
  EXPECT_NE(r.output.find(message_part), std::string::npos) << arguments << "\n" << r.output;
}

// kvlab perplexity's input errors: one line each, nothing computed (the runs themselves:
// tests/cpu_reference/test_perplexity.cpp and the real-model tests).
TEST(Cli, PerplexityRefusesBadInput) {
  const std::string text = std::string(KVLAB_SOURCE_DIR) + "/data/wikitext-2-raw/wiki.test.raw";
  expect_failure("perplexity --model stories15m -f " + text, "is a preset: perplexity needs");
  expect_failure("perplexity --model stories15m -f /nonexistent.txt", "/nonexistent.txt");
  expect_failure("perplexity --model stories15m -f " + text + " --kv-dtype q5_k",
                 "--kv-dtype must be one of f32, f16, bf16, fp8, int8, q8_0, q4_0, q4_1, int2, "
                 "kivi2, kivi4, not \"q5_k\"");
  expect_failure("perplexity --model stories15m -f " + text + " --window -1", "--window");
  expect_failure("perplexity -f " + text, "--model");
  const std::string run = "perplexity --model stories15m -f " + text;
  expect_failure(run + " --kv-policy h20", "did you mean \"h2o\"");
  expect_failure(run + " --kv-policy h2o --kv-param budget=0", "budget");
  expect_failure(run + " --kv-policy h2o --kv-param budget", "expected key=value");
  expect_failure(run + " --kv-policy h2o --kv-param sinks=4", "sinks");
  expect_failure(run + " --kv-policy streaming_llm --kv-param budget=4 --kv-param sinks=4",
                 "sinks must be below the budget");
  expect_failure(run + " --kv-param budget=8", "--kv-param needs --kv-policy");
  expect_failure(run + " --kv-policy window --kv-step 0", "--kv-step must be >= 1");
}

// kvlab serve's input errors: one line each, before anything listens (its routes:
// tests/serve/; the binary against real clients: serve.openai_sdk, serve.aiperf).
TEST(Cli, ServeRefusesBadInputBeforeListening) {
  const std::string quickstart = std::string(KVLAB_SOURCE_DIR) + "/experiments/quickstart.toml";
  const std::string one = quickstart + " --set scheduler.name=fcfs --max-seconds 1";
  expect_failure("serve " + quickstart,
                 "expands to 2: scheduler.name=static; scheduler.name=fcfs. Pick one with --set");
  expect_failure("serve " + one + " --host nothost", "--host nothost: not an IP address");
  expect_failure("serve " + one + " --port 70000", "--port 70000: not in 0..65535");
  expect_failure("serve " + one + " --max-queued 0", "--max-queued must be >= 1");
  expect_failure("serve " + one + " --max-body-mb 0", "--max-body-mb must be in (0, 1024]");
  // A timeout or deadline past a day (or a year) once overflowed the clock and dropped every
  // connection at once.
  for (const char* timeout : {"0", "inf", "1e300", "1e10", "nan"})
    expect_failure("serve " + one + " --read-timeout " + timeout, "must be in (0, 86400] seconds");
  for (const char* seconds : {"-1", "inf", "1e300"})
    expect_failure("serve " + quickstart + " --set scheduler.name=fcfs --max-seconds " + seconds,
                   "must be in [0, 31600000]");
  expect_failure("serve " + one + " --ui everything", "--ui");
  expect_failure("serve " + one + " --max-users 0", "--max-users must be >= 1");
  expect_failure("serve /nonexistent.toml", "/nonexistent.toml");
  // A results folder that holds an earlier run is refused before serving, not after it.
  test::TempDir out;
  ASSERT_EQ(run("serve " + one + " --port 0 --out " + out.path().string()).exit_code, 0);
  const RunResult again = run("serve " + one + " --port 0 --out " + out.path().string());
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.output.find("pass --force"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("on http://"), std::string::npos) << again.output;
}

// A data set that is not installed (none is in the repository) is an error naming the command
// that installs it, not a crash or an empty run.
TEST(Cli, AMissingDataSetNamesTheCommandThatInstallsIt) {
  const std::string experiments = std::string(KVLAB_SOURCE_DIR) + "/experiments/";
  expect_failure("run " + experiments +
                     "mooncake_replay.toml --set workload.trace=\"/nowhere/data/mooncake-fast25/"
                     "conversation_trace.jsonl\"",
                 "scripts/get_data.sh mooncake installs it");
  expect_failure("run " + experiments +
                     "azure_conv_replay.toml --set workload.azure_trace.file=\"/nowhere/data/"
                     "azure-llm-inference-2023/AzureLLMInferenceTrace_conv.csv\"",
                 "scripts/get_data.sh azure installs it");
  expect_failure(
      "perplexity --model /nonexistent.gguf -f /nowhere/data/wikitext-2-raw/wiki.test.raw",
      "scripts/get_data.sh wikitext2 installs it");
}

TEST(Cli, MissingModelFolder) {
  expect_failure("generate --model /nonexistent/model --prompt-ids 1,2",
                 "neither a preset, a model folder nor a .gguf file");
}

TEST(Cli, MisspelledPresetGetsASuggestion) {
  expect_failure("generate --preset stories15 --prompt-ids 1,2", "did you mean \"stories15m\"");
}

TEST(Cli, BadPromptIds) {
  expect_failure("generate --preset tiny --prompt-ids 1,x,3", "item 1 (\"x\") is not an integer");
  expect_failure("generate --preset tiny --prompt-ids 1,,3", "item 1 (\"\") is not an integer");
  expect_failure("generate --preset tiny --prompt-ids 1,-4", "item 1 (-4) is negative");
  expect_failure("generate --preset tiny --prompt-ids 1,512",
                 "prompt token id 512 (item 1) is outside the vocabulary");
  expect_failure("generate --preset tiny --prompt-ids 99999999999", "is not an integer");
}

TEST(Cli, MissingOrConflictingArguments) {
  expect_failure("generate --preset tiny", "--prompt-ids, --prompt or --chat");
  expect_failure("generate --prompt-ids 1", "--model or --preset");
  expect_failure("generate --preset tiny --model tiny --prompt-ids 1", "excludes");
  expect_failure("generate --preset tiny --prompt-ids 1 --top-p 0", "top_p must be in (0, 1]");
  expect_failure("generate --preset tiny --prompt-ids 1 --max-tokens nope", "--max-tokens");
  expect_failure("frobnicate", "frobnicate");
  // Usage errors exit 2 with the same prefix as every other error (docs/cli.md).
  for (const char* usage : {"generate --preset tiny --prompt-ids 1 --no-such-flag", "run",
                            "memory --model llama-7b --seq-len many"}) {
    const RunResult r = run(usage);
    EXPECT_EQ(r.exit_code, 2) << usage << "\n" << r.output;
    EXPECT_EQ(r.output.rfind("kvlab: error: ", 0), 0u) << usage << "\n" << r.output;
  }
  expect_failure("generate --preset tiny --prompt text", "needs the model's tokenizer");
  expect_failure("generate --preset tiny --chat hello", "--chat needs the model's tokenizer");
  // An empty message is still a chat message (it was taken for no --chat at all).
  expect_failure("generate --preset tiny --chat ''", "--chat needs the model's tokenizer");
  expect_failure("generate --preset tiny --prompt-ids 1 --system hi", "requires --chat");
  expect_failure("generate --preset tiny --prompt hi --chat hello", "excludes");
}

TEST(Cli, SizeOnlyPresetCannotGenerate) {
  expect_failure("generate --preset llama-7b --prompt-ids 1", "size-only");
}

TEST(Cli, BrokenModelFolder) {
  test::TempDir dir;
  test::write_file(dir / "config.json", "{\"vocab_size\": ");
  expect_failure("generate --model " + dir.path().string() + " --prompt-ids 1", "not valid JSON");
  const RunResult init =
      run("model init --preset tiny --seed 1 --force --out " + dir.path().string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
  test::write_file(dir / "model.safetensors", "garbage!garbage!");
  expect_failure("generate --model " + dir.path().string() + " --prompt-ids 1",
                 "model.safetensors");
}

TEST(Cli, ModelInitThenGenerateEqualsThePreset) {
  test::TempDir dir;
  const RunResult init = run("model init --preset tiny --seed 9 --out " + (dir / "m").string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const RunResult from_folder =
      run("generate --model " + (dir / "m").string() + " --prompt-ids 1,2,3 --max-tokens 6");
  const RunResult from_preset =
      run("generate --preset tiny --weights-seed 9 --prompt-ids 1,2,3 --max-tokens 6");
  ASSERT_EQ(from_folder.exit_code, 0) << from_folder.output;
  ASSERT_EQ(from_preset.exit_code, 0) << from_preset.output;
  EXPECT_EQ(from_folder.stdout_only, from_preset.stdout_only);
  EXPECT_NE(from_folder.stdout_only.find("generated: ["), std::string::npos);
}

// --compute engine serves the same prompt through the engine (paged KV cache, batched CPU
// backend): the same greedy tokens as the full-recompute reference, logprobs within 1e-4.
TEST(Cli, EngineComputeGivesTheReferencesTokens) {
  const std::string base =
      "generate --preset stories15m --prompt-ids 1,450,4996,1,2,3 "
      "--max-tokens 24 --ignore-eos --logprobs 3 --json --compute ";
  const RunResult reference = run(base + "reference");
  const RunResult engine = run(base + "engine");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(engine.exit_code, 0) << engine.output;
  EXPECT_NE(engine.output.find("engine with a paged KV cache"), std::string::npos) << engine.output;
  std::istringstream a(reference.stdout_only), b(engine.stdout_only);
  int count = 0;
  for (std::string x, y; std::getline(a, x) && std::getline(b, y); ++count) {
    const auto want = nlohmann::json::parse(x), got = nlohmann::json::parse(y);
    EXPECT_EQ(got["token"], want["token"]) << count;
    EXPECT_NEAR(got["logprob"].get<double>(), want["logprob"].get<double>(), 1e-4) << count;
    ASSERT_EQ(got["top_logprobs"].size(), 3u);
    ASSERT_EQ(want["top_logprobs"].size(), 3u);
    for (std::size_t k = 0; k < 3; ++k) {
      const auto &g = got["top_logprobs"][k], &w = want["top_logprobs"][k];
      EXPECT_EQ(g["token"], w["token"]) << count << " top " << k;
      EXPECT_NEAR(g["logprob"].get<double>(), w["logprob"].get<double>(), 1e-4) << count;
    }
  }
  EXPECT_EQ(count, 24);
  expect_failure("generate --preset tiny --prompt-ids 1 --compute fast", "--compute");
  // The engine computes logprobs as it picks each token, up to vLLM's 20; the reference any.
  expect_failure("generate --preset tiny --prompt-ids 1 --compute engine --logprobs 21",
                 "--logprobs 21: the engine returns at most 20");
  EXPECT_EQ(run("generate --preset tiny --prompt-ids 1 --max-tokens 2 --logprobs 21").exit_code, 0);
}

// --activations q8 (with Q weights) runs the engine's products on 8-bit activations: it says
// so, and it needs the engine; an unknown format is refused by name.
TEST(Cli, Q8ActivationsRunThroughTheEngineOnly) {
  const RunResult r =
      run("generate --preset stories15m --prompt-ids 1,450,4996 --max-tokens 8 --ignore-eos "
          "--compute engine --weights q4_0 --activations q8 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(std::count(r.stdout_only.begin(), r.stdout_only.end(), '\n'), 8) << r.output;
  expect_failure("generate --preset tiny --prompt-ids 1 --activations q8",
                 "--activations q8 needs --compute engine");
  expect_failure("generate --preset tiny --prompt-ids 1 --compute engine --activations q4",
                 "--activations");
}

TEST(Cli, JsonOutputHasOneObjectPerPosition) {
  const RunResult r = run(
      "generate --preset tiny --prompt-ids 1,2,3 --max-tokens 5 --ignore-eos --logprobs 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream lines(r.stdout_only);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    const auto object = nlohmann::json::parse(line);
    EXPECT_EQ(object["index"], count);
    EXPECT_EQ(object["position"], 3 + count);
    ASSERT_EQ(object["top_logprobs"].size(), 4u);
    EXPECT_EQ(object["top_logprobs"][0]["token"], object["token"]);  // greedy: the top token
    EXPECT_LE(object["logprob"].get<double>(), 0.0);
    ++count;
  }
  EXPECT_EQ(count, 5);
}

// A tiny preset's folder with a SentencePiece model trained here with the real trainer
// (vocab 60 < the tiny model's 512).
void make_tiny_model_with_tokenizer(const test::TempDir& dir) {
  ASSERT_EQ(run("model init --preset tiny --out " + dir.path().string()).exit_code, 0);
  std::string corpus;
  for (int i = 0; i < 2000; ++i) corpus += (i % 3 ? "once upon a time " : "there was a cat.\n");
  test::write_file(dir / "corpus.txt", corpus);
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "corpus.txt").string() +
      " --model_prefix=" + (dir / "tokenizer").string() +
      " --vocab_size=60 --model_type=bpe --minloglevel=2 --bos_id=1 --eos_id=2 --unk_id=0");
  ASSERT_TRUE(status.ok()) << status.ToString();
}

TEST(Cli, TextPromptWithTokenizer) {
  test::TempDir dir;
  make_tiny_model_with_tokenizer(dir);
  const RunResult r = run("generate --model " + dir.path().string() +
                          " --prompt \"once upon\" --max-tokens 3 --ignore-eos");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.stdout_only.find("prompt:    [1, "), std::string::npos)
      << r.stdout_only;  // BOS first
  EXPECT_NE(r.stdout_only.find("text:"), std::string::npos) << r.stdout_only;
  const RunResult j =
      run("generate --model " + dir.path().string() + " --prompt-ids 1,5 --max-tokens 2 --json");
  ASSERT_EQ(j.exit_code, 0) << j.output;
  EXPECT_TRUE(
      nlohmann::json::parse(j.stdout_only.substr(0, j.stdout_only.find('\n'))).contains("text"));
}

// A chat answer runs to the model's own stop, not the 16 tokens of the sampling default (with
// EOS ignored: to the context's end), and generate prints the prompt's rate up to the first
// token and the decode rate after it, as llama.cpp does.
TEST(Cli, ChatAnswersUpToItsStopAndPrintsPromptAndDecodeRates) {
  test::TempDir dir;
  make_tiny_model_with_tokenizer(dir);
  test::write_file(dir / "chat_template.jinja",  // detected as Llama-2's by its [INST]
                   "{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]");
  const RunResult r = run("generate --model " + dir.path().string() +
                          " --chat \"once upon\" --ignore-eos --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::size_t at = r.output.find(" prompt tokens, ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::int64_t prompt = std::stoll(r.output.substr(r.output.rfind(' ', at - 1) + 1));
  const std::int64_t generated = std::stoll(r.output.substr(at + 16));
  EXPECT_EQ(prompt + generated, 512) << r.output;  // the tiny preset's context, filled
  EXPECT_NE(r.output.find("finish=context_full"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("prompt: " + std::to_string(prompt) + " tokens in "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("tok/s; time to first token)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("decode: " + std::to_string(generated - 1) + " tokens in "),
            std::string::npos)
      << r.output;
  const RunResult capped =
      run("generate --model " + dir.path().string() + " --chat hi --ignore-eos --max-tokens 5");
  EXPECT_NE(capped.output.find(" prompt tokens, 5 generated"), std::string::npos) << capped.output;
}

TEST(Cli, MemorySizesThatOverflowAreErrors) {
  // Used to print a negative size.
  expect_failure("memory --model llama-7b --seq-len 9223372036854775807",
                 "more bytes than 64 bits can count");
  expect_failure("memory --model llama-7b --seq-len 4096 --batch 4611686018427387904",
                 "more bytes than 64 bits can count");
}

TEST(Cli, MemoryReproducesTheSeedTableCorrectly) {
  const RunResult r = run("memory --model llama-7b --seq-len 2048 --batch 1 --dtype f16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["bytes_per_request"], 1LL << 30);
  EXPECT_EQ(j["variants"][0]["variant"], "MHA");
  bool saw_gqa = false, saw_mqa = false;
  for (const auto& v : j["variants"]) {
    if (v["variant"] == "GQA-8") saw_gqa = (v["ratio_to_mha"] == 0.25);
    if (v["variant"] == "MQA") saw_mqa = (v["ratio_to_mha"] == 1.0 / 32);
  }
  EXPECT_TRUE(saw_gqa && saw_mqa) << r.stdout_only;
  const RunResult text = run("memory --model llama-7b --seq-len 2048 --gpu-mem 80");
  EXPECT_NE(text.stdout_only.find("1.00 GiB"), std::string::npos) << text.stdout_only;
  EXPECT_NE(text.stdout_only.find("67"), std::string::npos) << text.stdout_only;
  expect_failure("memory --model llama-7b --seq-len 2048 --kv-heads 3", "kv-heads 3");
  expect_failure("memory --model llama-7b --seq-len 2048 --dtype f64",
                 "--dtype must be one of f32, f16, bf16, fp8, int8, q8_0, q4_0, q4_1, int2, kivi2, "
                 "kivi4, not \"f64\"");
  expect_failure("memory --model stories15m --seq-len 64 --dtype q8_0",  // head_dim 48
                 "q8_0 KV needs head_dim to be a multiple of 32");
  expect_failure("memory --model llama-7b", "--seq-len");
}

TEST(Cli, ModelInfo) {
  const RunResult r = run("model info stories15m");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.stdout_only.find("15191712"), std::string::npos) << r.stdout_only;
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

TEST(Cli, AllocatorConformanceOnAShippedAndABrokenPlugin) {
  const RunResult good =
      run("plugins conformance paged --param block_size=4 --release-window --rollback");
  EXPECT_EQ(good.exit_code, 0) << good.output;
  EXPECT_NE(good.output.find("allocator paged: 9000 random operations over 3 seeds"),
            std::string::npos)
      << good.output;
  EXPECT_NE(good.output.find("tokens rolled back"), std::string::npos) << good.output;
  const RunResult broken = run(std::string("plugins conformance broken_shared_slots --load ") +
                               KVLAB_TEST_PLUGIN_DIR + "/kvlab_plugin_test_broken_allocator.so");
  EXPECT_EQ(broken.exit_code, 1) << broken.output;
  EXPECT_NE(broken.output.find("FAIL seed 1: operation 0"), std::string::npos) << broken.output;
  EXPECT_NE(broken.output.find("does not conform (3 of 3 seeds failed)"), std::string::npos);
  expect_failure("plugins conformance paged --param block_size", "expected key=value");
  expect_failure("plugins conformance paged --param block_size=x", "must be an integer");
}

}  // namespace
}  // namespace kvlab
