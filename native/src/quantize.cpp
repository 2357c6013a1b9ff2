#include "quantize.h"

#include <cmath>

namespace lcg {

namespace {

constexpr float MIN_STEP = 6.103515625e-05f;  // smallest normal f16

} // namespace

QuantKnobs level_knobs(int32_t level) {
    switch (level) {
        // Tuned on SmolLM2-135M, 2,048 tokens (bench/): a uniform step over layers measured as good
        // as or better than finer shallow layers at equal size, so the presets keep the ramp flat.
        case LCG_LEVEL_HIGH: return {0.115f, 0.115f, 1.0f, 4};
        case LCG_LEVEL_BALANCED: return {0.45f, 0.45f, 1.0f, 4};
        case LCG_LEVEL_COMPACT: return {0.72f, 0.72f, 1.0f, 4};
        default: return {0.0f, 0.0f, 1.0f, 0};
    }
}

float layer_step(const QuantKnobs & k, bool is_v, uint32_t layer, uint32_t n_layer) {
    const float last = is_v ? k.v_step : k.k_step;
    const float t = n_layer > 1 ? static_cast<float>(layer) / static_cast<float>(n_layer - 1) : 1.0f;
    return last * (k.first_layer_scale + (1.0f - k.first_layer_scale) * t);
}

ChannelQuant channel_quant(double mean, double step) {
    float s = static_cast<float>(step);
    if (!(s >= MIN_STEP)) {
        s = step > 0.0 ? MIN_STEP : 1.0f;
    }
    ChannelQuant cq;
    cq.mean_f16 = f32_to_f16(std::isfinite(mean) ? static_cast<float>(mean) : 0.0f);
    cq.step_f16 = f32_to_f16(std::min(s, 65504.0f));
    return cq;
}

void store_float(uint8_t * p, int32_t ggml_type, float v) {
    if (ggml_type == GGML_F32) {
        std::memcpy(p, &v, 4);
        return;
    }
    const uint16_t h = ggml_type == GGML_F16 ? f32_to_f16(v) : f32_to_bf16(v);
    std::memcpy(p, &h, 2);
}

float dequant_value(const ChannelQuant & cq, int64_t q) {
    const float shrink = static_cast<float>(cq.shrink_u8) * (1.0f / 256.0f);
    const float level = q > 0 ? static_cast<float>(q) - shrink : q < 0 ? static_cast<float>(q) + shrink : 0.0f;
    return f16_to_f32(cq.mean_f16) + level * f16_to_f32(cq.step_f16);
}

void build_dequant(const ChannelQuant & cq, int32_t ggml_type, DequantTable & t) {
    t.value[SYM_ESCAPE] = 0;
    for (int s = 1; s < 256; s++) {
        const float v = dequant_value(cq, s - SYM_ZERO);
        uint8_t bytes[4] = {0, 0, 0, 0};
        store_float(bytes, ggml_type, v);
        std::memcpy(&t.value[s], bytes, 4);
    }
}

} // namespace lcg
