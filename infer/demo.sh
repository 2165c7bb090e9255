#!/usr/bin/env bash
# The sharing demo: one kvmmd, four kvmm-generate processes running SmolLM2-135M-Instruct with long
# prompts whose f16 KV together is several times the daemon's device budget, so kvmmd demotes their
# pages to its DRAM pool and sealed flash file while they decode, and faults them back in.
#
#   infer/demo.sh            # from the repository root, with ../shared beside it
#
# Each process first runs alone (the only session on the daemon), then all four run together; the
# script prints every output, checks that each process wrote the same text together as alone, and
# reports tokens/s alone and together, then `kvmmctl status` taken while all four were attached and
# once they were done (tiers, demotions, faults). Pages demote exactly by default, so the outputs must
# match; KVMM_DEMO_DEMOTE=q8 (or q4, k8v4) demotes lossily and reports where the texts part instead.
#
# Environment: KVMM_DEMO_DEVICE (device budget, default 16MiB), KVMM_DEMO_DRAM (default 16MiB),
# KVMM_DEMO_FLASH (default 256MiB), KVMM_DEMO_TOKENS (tokens to generate, default 48),
# KVMM_DEMO_PROMPT_CHARS (characters of the shipped text per prompt, default 2400), KVMM_DEMO_DIR
# (work directory, default a new one under /tmp; the flash file goes there and must take O_DIRECT).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE="${KVMM_DEMO_DEVICE:-16MiB}"
DRAM="${KVMM_DEMO_DRAM:-16MiB}"
FLASH="${KVMM_DEMO_FLASH:-256MiB}"
TOKENS="${KVMM_DEMO_TOKENS:-48}"
CHARS="${KVMM_DEMO_PROMPT_CHARS:-2400}"
DEMOTE="${KVMM_DEMO_DEMOTE:-none}"
WORK="${KVMM_DEMO_DIR:-$(mktemp -d /tmp/kvmm-demo.XXXXXX)}"
mkdir -p "$WORK/run" "$WORK/flash"

MODEL="$(bash ../shared/scripts/fetch-smollm2.sh)"
echo "== building (release)"
cargo build --release --quiet -p kvmm-daemon -p kvmm-ctl -p kvmm-infer --bins
BIN=target/release
SOCKET="$WORK/run/kvmm.sock"

"$BIN/kvmmd" --runtime-dir "$WORK/run" --device-budget "$DEVICE" --dram-budget "$DRAM" \
  --flash-budget "$FLASH" --flash-dir "$WORK/flash" --demote-format "$DEMOTE" --mode performance \
  2> "$WORK/kvmmd.log" &
DAEMON=$!
trap 'kill "$DAEMON" 2>/dev/null; wait "$DAEMON" 2>/dev/null || true' EXIT
for _ in $(seq 200); do [ -S "$WORK/run/kvmm-admin.sock" ] && break; sleep 0.05; done
[ -S "$WORK/run/kvmm-admin.sock" ] || { cat "$WORK/kvmmd.log"; echo "kvmmd did not start"; exit 1; }
ctl() { "$BIN/kvmmctl" --socket "$WORK/run/kvmm-admin.sock" "$@"; }

# Four long prompts: consecutive excerpts of the shipped public-domain text, each with a question.
TEXT="$(cat infer/texts/us-constitution.txt)"
QUESTIONS=(
  "Which body of government does this passage describe? Answer in two sentences."
  "List three powers this passage grants."
  "Who is allowed to do what, according to this passage? Answer briefly."
  "Summarize this passage for a child."
)
for i in 0 1 2 3; do
  printf '%s\n\n%s' "${TEXT:$((i * CHARS)):$CHARS}" "${QUESTIONS[$i]}" > "$WORK/prompt$i.txt"
done

run() { # run NAME I: one kvmm-generate on prompt I, its text to NAME.out and its report to NAME.err
  "$BIN/kvmm-generate" --model "$MODEL" --chat --prompt "$(cat "$WORK/prompt$2.txt")" \
    --max-tokens "$TOKENS" --kv kvmm --socket "$SOCKET" > "$WORK/$1.out" 2> "$WORK/$1.err"
}
rate() { grep -o "$2: [0-9]* tokens[^(]*([0-9.]* tokens/s)" "$WORK/$1.err" | grep -o '[0-9.]* tokens/s' | cut -d' ' -f1; }
kv_kib() { # f16 KV of a run: tokens held × bytes per token of SmolLM2 (30 layers, 3 KV heads × 64, K and V)
  local prompt generated
  prompt="$(grep -o 'prompt: [0-9]* tokens' "$WORK/$1.err" | grep -o '[0-9]*')"
  generated="$(grep -o 'generated: [0-9]* tokens' "$WORK/$1.err" | grep -o '[0-9]*')"
  echo "$(( (prompt + generated) * 30 * 3 * 64 * 2 * 2 / 1024 ))"
}

echo "== alone: each process is the daemon's only session"
for i in 0 1 2 3; do run "alone$i" "$i"; done

echo "== together: four processes, device budget $DEVICE, DRAM $DRAM, flash $FLASH, demote $DEMOTE"
PIDS=()
for i in 0 1 2 3; do run "together$i" "$i" & PIDS+=($!); done
: > "$WORK/status-attached.txt"
while kill -0 "${PIDS[@]}" 2>/dev/null; do
  if { ctl status && ctl sessions; } > "$WORK/status.tmp" 2>&1 && grep -q '; 4 session(s)' "$WORK/status.tmp"; then
    mv "$WORK/status.tmp" "$WORK/status-attached.txt"
  fi
  sleep 1
done
FAILED=0
for pid in "${PIDS[@]}"; do wait "$pid" || FAILED=1; done
[ "$FAILED" = 0 ] || { tail -n 5 "$WORK"/together*.err; echo "a process failed"; exit 1; }

echo
TOTAL_KIB=0
SAME=0
for i in 0 1 2 3; do
  echo "--- process $i: ${QUESTIONS[$i]}"
  cat "$WORK/together$i.out"
  if cmp -s "$WORK/alone$i.out" "$WORK/together$i.out"; then
    echo "(the same text as alone)"
    SAME=$((SAME + 1))
  else
    echo "(differs from the text alone:)"
    cat "$WORK/alone$i.out"
  fi
  TOTAL_KIB=$((TOTAL_KIB + $(kv_kib "together$i")))
done

echo
echo "| process | prompt tokens | alone prompt tok/s | together prompt tok/s | alone decode tok/s | together decode tok/s |"
echo "|---|---:|---:|---:|---:|---:|"
for i in 0 1 2 3; do
  prompt="$(grep -o 'prompt: [0-9]* tokens' "$WORK/together$i.err" | grep -o '[0-9]*')"
  echo "| $i | $prompt | $(rate "alone$i" prompt) | $(rate "together$i" prompt) | $(rate "alone$i" generated) | $(rate "together$i" generated) |"
done
echo
echo "combined f16 KV of the four sessions: $((TOTAL_KIB / 1024)) MiB against a device budget of $DEVICE"
for i in 0 1 2 3; do echo "process $i: $(grep '^kv: kvmm session' "$WORK/together$i.err" | cut -d';' -f2-4)"; done
echo
echo "== kvmmctl status and sessions, last taken while all four were attached"
cat "$WORK/status-attached.txt"
echo "== kvmmctl status after they detached"
ctl status
echo "outputs the same together as alone: $SAME of 4 (demote format $DEMOTE); work directory $WORK"
if [ "$DEMOTE" = none ] && [ "$SAME" != 4 ]; then
  echo "with exact demotion every output must match"
  exit 1
fi
