"""Which base architectures each engine can serve an EAGLE-3 draft for. The engine's model code for the target has
to capture the three auxiliary hidden states the draft reads; for a target whose code does not, both engines refuse
the draft when it loads (vLLM: "Model does not support EAGLE3 interface"; SGLang: "does not implement
set_eagle3_layers_to_capture"). Read from the engines' released source on 2026-12-03: vLLM 0.34.0 (62d4bc3c7), the
architectures registered for text generation or multimodal models whose class implements SupportsEagle3 (its
Transformers backend implements it for whatever it runs, with --model-impl transformers); SGLang 0.5.23, the
EntryClass models with set_eagle3_layers_to_capture, defined or inherited (draft and MTP classes left out)."""

from __future__ import annotations

EAGLE3_READ_FROM = {"vllm": "vLLM 0.34.0", "sglang": "SGLang 0.5.23"}

EAGLE3_TARGETS = {
    "vllm": frozenset((
        "AfmoeForCausalLM Alpamayo2Super ApertusForCausalLM BeamForCausalLM Cohere2MoeForCausalLM "
        "CohereCompassForConditionalGeneration Cosmos3ForConditionalGeneration DeepseekForCausalLM "
        "DeepseekV2ForCausalLM DeepseekV32ForCausalLM DeepseekV3ForCausalLM DeepseekV41ForCausalLM "
        "DeepseekV4ForCausalLM Ernie4_5ForCausalLM Exaone4_5_ForConditionalGeneration Gemma4ForCausalLM "
        "Gemma4ForConditionalGeneration Gemma4UnifiedForConditionalGeneration Glm5NextForCausalLM "
        "Glm5NextForConditionalGeneration GlmMoeDsaForCausalLM GptOssForCausalLM GraniteForCausalLM "
        "GraniteMoeForCausalLM GraniteMoeSWAForCausalLM GraniteMoeSharedForCausalLM GraniteSWAForCausalLM "
        "IQuestCoderForCausalLM InternLM3ForCausalLM InternS1ProForConditionalGeneration "
        "InternS2MobiusForConditionalGeneration InternS2PreviewForConditionalGeneration K2HorizonForCausalLM "
        "KimiK25ForConditionalGeneration KimiK31ForConditionalGeneration KimiK3ForConditionalGeneration "
        "LLaMAForCausalLM LagunaForCausalLM LightOnOCRForConditionalGeneration Llama4ForCausalLM "
        "Llama4ForConditionalGeneration LlamaForCausalLM LlavaForConditionalGeneration MiMoForCausalLM "
        "MiMoV2FlashForCausalLM MiMoV2ForCausalLM MiMoV2OmniForCausalLM MiniCPM3ForCausalLM MiniCPMForCausalLM "
        "MiniCPMOcrForConditionalGeneration MiniCPMV4_6ForConditionalGeneration "
        "MiniCPMV4_7ForConditionalGeneration MiniMaxM2ForCausalLM MiniMaxM3SparseForCausalLM "
        "MiniMaxM3SparseForConditionalGeneration Ministral3ForCausalLM Mistral3ForConditionalGeneration "
        "MistralForCausalLM MistralLarge3ForCausalLM MistralLarge4ForCausalLM MuseGlimmerForCausalLM "
        "MuseGlimmerForConditionalGeneration MuseSparkForConditionalGeneration "
        "Nemotron3_5TranscribeForConditionalGeneration NemotronHForCausalLM NemotronHPuzzleForCausalLM "
        "NemotronH_Nano_Omni_Reasoning_V3 NemotronH_Nano_VL_V2 NemotronH_Omni_Reasoning_V3 "
        "NemotronH_Super_Omni_Reasoning_V3 OpenCUAForConditionalGeneration Phi3ForCausalLM "
        "PixtralForConditionalGeneration Plamo3ForCausalLM Qwen2ForCausalLM Qwen2_5_VLForConditionalGeneration "
        "Qwen3ASRForConditionalGeneration Qwen3ASRRealtimeGeneration Qwen3ForCausalLM Qwen3MoeForCausalLM "
        "Qwen3NextForCausalLM Qwen3OmniMoeForConditionalGeneration Qwen3VLForConditionalGeneration "
        "Qwen3VLMoeForConditionalGeneration Qwen3_5ForCausalLM Qwen3_5ForConditionalGeneration "
        "Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration Qwen4ExpForConditionalGeneration "
        "RadioMBartPrefixForCausalLM RicursiveForCausalLM SarvamMLAForCausalLM Step1ForCausalLM "
        "TeleChat2ForCausalLM TeleChat3ForCausalLM TeleFLMForCausalLM UnlimitedOCR2TextForCausalLM "
    ).split()),
    "sglang": frozenset((
        "ApertusForCausalLM BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM "
        "Cosmos3ForConditionalGeneration DeepseekV2ForCausalLM DeepseekV32ForCausalLM DeepseekV3ForCausalLM "
        "ExaoneMoEForCausalLM ExaoneMoeForCausalLM Gemma3ForCausalLM Gemma3ForConditionalGeneration "
        "Gemma4ForCausalLM Gemma4ForConditionalGeneration Gemma4UnifiedForConditionalGeneration "
        "Glm4MoeForCausalLM Glm4MoeLiteForCausalLM Glm5NextForConditionalGeneration GlmMoeDsaForCausalLM "
        "GptOssForCausalLM IQuestCoderForCausalLM InternLM3ForCausalLM InternS1ProForConditionalGeneration "
        "InternS2MobiusForConditionalGeneration InternS2PreviewForConditionalGeneration "
        "KimiK25ForConditionalGeneration Llama4ForCausalLM Llama4ForConditionalGeneration LlamaForCausalLM "
        "LongcatFlashForCausalLM MellumForCausalLM MindSporeForCausalLM MiniMaxM2ForCausalLM "
        "MiniMaxM3SparseForCausalLM MiniMaxM3SparseForConditionalGeneration Ministral3ForCausalLM "
        "MistralForCausalLM MistralLarge3ForCausalLM Phi3ForCausalLM Qwen2ForCausalLM Qwen2MoeForCausalLM "
        "Qwen2_5_VLForConditionalGeneration Qwen3ForCausalLM Qwen3MoeForCausalLM Qwen3NextForCausalLM "
        "Qwen3VLForConditionalGeneration Qwen3VLMoeForConditionalGeneration Qwen3_5ForCausalLM "
        "Qwen3_5ForConditionalGeneration Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration "
        "Qwen4ExpForConditionalGeneration SarvamMoEForCausalLM TeleFLMForCausalLM "
    ).split()),
}
