/* The layouts Python mirrors (ctypes.Structure, memoryview strides) and the constants it
   shares, by name: runtime/native.py's check_layout compares them with the Python side when
   the library loads, so a struct edited on one side only is an error, not memory corruption.
   A struct's entry gives its sizeof, a field's its offset and size; a field missing here makes
   the check fail too (Python asks for every field it declares). */
#include <stddef.h>

#include "loom_cpu.h"

typedef struct {
    const char* name;
    int64_t value, size;
} Entry;

#define STRUCT(S) {#S, 0, (int64_t)sizeof(S)}
#define FIELD(S, f) {#S "." #f, (int64_t)offsetof(S, f), (int64_t)sizeof(((S*)0)->f)}
#define CONSTANT(c) {#c, (int64_t)(c), 0}

static const Entry entries[] = {
    STRUCT(Layer),
    FIELD(Layer, ln1),
    FIELD(Layer, qkv_w),
    FIELD(Layer, qkv_b),
    FIELD(Layer, q_norm),
    FIELD(Layer, k_norm),
    FIELD(Layer, o_w),
    FIELD(Layer, o_b),
    FIELD(Layer, ln2),
    FIELD(Layer, gu_w),
    FIELD(Layer, gu_b),
    FIELD(Layer, down_w),
    FIELD(Layer, down_b),
    FIELD(Layer, k_cache),
    FIELD(Layer, v_cache),
    FIELD(Layer, qkv_p),
    FIELD(Layer, o_p),
    FIELD(Layer, gu_p),
    FIELD(Layer, down_p),
    STRUCT(Model),
    FIELD(Model, hidden),
    FIELD(Model, heads),
    FIELD(Model, kv_heads),
    FIELD(Model, head_dim),
    FIELD(Model, inter),
    FIELD(Model, vocab),
    FIELD(Model, layers),
    FIELD(Model, max_pos),
    FIELD(Model, eps),
    FIELD(Model, scale),
    FIELD(Model, embed),
    FIELD(Model, norm),
    FIELD(Model, lm_head),
    FIELD(Model, cos),
    FIELD(Model, sin),
    FIELD(Model, layer),
    FIELD(Model, lm_head_p),
    FIELD(Model, embed_q),
    FIELD(Model, lm_head_q),
    FIELD(Model, q_mode),
    FIELD(Model, kv_bf16),
    FIELD(Layer, qkv_q),
    FIELD(Layer, o_q),
    FIELD(Layer, gu_q),
    FIELD(Layer, down_q),
    FIELD(Layer, post_attn_ln),
    FIELD(Layer, post_ff_ln),
    FIELD(Layer, cos),
    FIELD(Layer, sin),
    FIELD(Layer, window),
    FIELD(Model, act),
    FIELD(Model, embed_scale),
    FIELD(Model, norm_add),
    STRUCT(QSeg),
    FIELD(QSeg, qtype),
    FIELD(QSeg, row0),
    FIELD(QSeg, rows),
    FIELD(QSeg, row_bytes),
    FIELD(QSeg, data),
    STRUCT(Head),
    FIELD(Head, variant),
    FIELD(Head, hidden),
    FIELD(Head, heads),
    FIELD(Head, kv_heads),
    FIELD(Head, head_dim),
    FIELD(Head, inter),
    FIELD(Head, layers),
    FIELD(Head, max_pos),
    FIELD(Head, vocab),
    FIELD(Head, dvocab),
    FIELD(Head, fc_in),
    FIELD(Head, eps),
    FIELD(Head, scale),
    FIELD(Head, embed),
    FIELD(Head, fc_w),
    FIELD(Head, fc_b),
    FIELD(Head, in_norm),
    FIELD(Head, hidden_norm),
    FIELD(Head, norm),
    FIELD(Head, lm_head),
    FIELD(Head, cos),
    FIELD(Head, sin),
    FIELD(Head, d2t),
    FIELD(Head, layer),
    FIELD(Head, fc_p),
    FIELD(Head, lm_p),
    FIELD(Head, fc_bf),
    FIELD(Head, lm_bf),
    FIELD(Head, layer_bf),
    FIELD(Head, bf16_inputs),
    STRUCT(Node),
    FIELD(Node, parent),
    FIELD(Node, token),
    FIELD(Node, count),
    FIELD(Node, stamp),
    FIELD(Node, ostamp),
    FIELD(Node, queued),
    FIELD(Node, nxt),
    FIELD(Node, died),
    FIELD(Node, first),
    FIELD(Node, last),
    FIELD(Node, next),
    FIELD(Node, prev),
    FIELD(Node, nkids),
    FIELD(Node, live),
    FIELD(Node, pad0),
    FIELD(Node, pad1),
    CONSTANT(NGT_DEPTH),
    CONSTANT(NGT_CAPACITY),
    CONSTANT(NGT_MAX_IDS),
    CONSTANT(NGT_N_IDS),
    CONSTANT(NGT_SIZE),
    CONSTANT(NGT_TAIL),
    CONSTANT(NGT_CLOCK),
    CONSTANT(NGT_EVICTED_AT),
    CONSTANT(NGT_NFREE),
    CONSTANT(NGT_TABLE),
    CONSTANT(NGT_MASK),
    CONSTANT(NGT_HEADER),
    CONSTANT(NGT_ROOT),
    CONSTANT(NGT_CUT),
    CONSTANT(NGT_GROW),
    CONSTANT(NGT_SECOND_CHANCES),
    CONSTANT(PANEL),
};

int loom_layout(const char* name, int64_t* value, int64_t* size) {
    for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++)
        if (strcmp(entries[i].name, name) == 0) {
            *value = entries[i].value;
            *size = entries[i].size;
            return 0;
        }
    return -1;
}
