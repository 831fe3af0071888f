# Profiling and training modes (sourced by scripts/gpu_session.sh).

#: profile      host time per engine-step section, plain vs speculative engines, torch.profiler tables of
#:              DFlash passes at T=0 and T=1, and one graph step's time by verify width and output
#:              (scripts/profile_spec_steps.py)
mode_profile() {
  step profile "${SECONDS_PROFILE:-240}" python3 scripts/profile_spec_steps.py --trace dflash:0 --trace dflash:1
  grep "pass 1" "$out/profile.log"
  step step-costs 120 python3 scripts/profile_spec_steps.py --step-costs
  grep "^|" "$out/step-costs.log"
}

#: idle         a DFlash engine that never drafts against plain decoding, with and without its taps
#:              (profile_spec_steps.py --idle-overhead, ~2 min)
mode_idle() {
  step idle "${SECONDS_IDLE:-240}" python3 scripts/profile_spec_steps.py --idle-overhead
  grep "plain (" "$out/idle.log"
}

#: drafter      the default drafter (scripts/train_default_drafter.sh, ~7 min)
mode_drafter() {
  step drafter 570 bash scripts/train_default_drafter.sh "$out/default-dflash" "${SECONDS_TRAIN:-300}"
  rm -f "$out/default-dflash/train_state.pt" "$out/default-dflash/regenerated.pt"
  tr '\r' '\n' < "$out/drafter.log" | grep -E "tau|steps|wrote|Error|error" | tail -n 20
}

#: drafter2     the bundled DFlash2 drafter (grown from the DFlash one on a CPU) trained further with the H200
#:              recipe (65K samples, batch 64), then tree tau over its lattice (scripts/tree_tau.py; ~9 min)
mode_drafter2() {
  ARCH=dflash2 INIT_DRAFTER=models/default-dflash LR=${LR:-3e-4} \
    step drafter 450 bash scripts/train_default_drafter.sh "$out/default-dflash2" "${SECONDS_TRAIN:-240}"
  rm -f "$out/default-dflash2/train_state.pt" "$out/default-dflash2/regenerated.pt"
  tr '\r' '\n' < "$out/drafter.log" | grep -E "tau|steps|wrote|Error|error" | tail -n 20
  step tree-tau 120 python3 scripts/tree_tau.py --drafter "$out/default-dflash2" --budgets 8 16 22 32 63
  step tree-tau-calibration 120 python3 scripts/tree_tau.py --drafter "$out/default-dflash2" --calibration \
    --tokens 96 --budgets 8 16 22 32 63
  tail -n 9 "$out/tree-tau.log" "$out/tree-tau-calibration.log"
}

#: profile-verify  where a hybrid verify's time goes: scripts/profile_decode.py at 1 and 16 tokens (eager
#:              tables + graph replay) on qwen3.6-27b and qwen3.6-35b-a3b q4_k_m (SHAPES, QUANT override)
mode_profile_verify() {
  local shape tokens
  for shape in ${SHAPES:-qwen3.6-27b qwen3.6-35b-a3b}; do
    for tokens in 1 16; do
      step "profile-$shape-$tokens" 150 python3 scripts/profile_decode.py --shape "$shape" \
        --quant "${QUANT:-q4_k_m}" --context 512 --tokens "$tokens" --rows 30
      grep "forward (" "$out/profile-$shape-$tokens.log"
    done
  done
}
