/*
 * nvme-offload native kernels: the optimizer math that torch has no kernel for.
 *
 * Read verbatim as the cffi cdef of offload._kernels (offload/_build.py), so it holds only what crosses
 * the boundary. Every element is computed in the order and with the roundings of a reference written with
 * torch's element-wise operations (offload.adam.lowbit), so the two agree bit for bit: fp32 arithmetic,
 * one rounding per operation, the fused multiply-add only where torch's vectorized lerp uses one.
 */

#define OFL_DTYPE_F32 0
#define OFL_DTYPE_BF16 1
#define OFL_DTYPE_F16 2

#define OFL_BLOCK 256           /* elements per block of 8-bit codes; one fp32 absmax per block */

/* One Adam step over n elements of one parameter, in place (torchao's AdamW8bit formula). */
typedef struct {
    int64_t n;                  /* elements */
    int64_t first;              /* index of the first element in its parameter: a multiple of OFL_BLOCK */
    float *param;               /* fp32 weights (a master copy or an fp32 parameter), or NULL */
    uint16_t *param_bf16;       /* bf16 weights without a master copy (stochastic rounding), or NULL */
    const void *grad;           /* n elements of grad_dtype */
    int grad_dtype;             /* OFL_DTYPE_* */
    /* exp_avg, exp_avg_sq, max_exp_avg_sq: 8-bit codes with one absmax per block, or fp32 values */
    uint8_t *codes[3];
    float *absmax[3];
    float *moment[3];
    const float *qmap_signed;   /* 256 ascending values: the code book of exp_avg */
    const float *qmap_unsigned; /* the code book of exp_avg_sq and max_exp_avg_sq */
    /* Per code book, the codes as a step function of an fp32 value's bits made sortable (s = bits ^ 0x80000000
     * for a positive value, ~bits for a negative one): for each upper 16 bits of s, the code of the lowest
     * value with them, plus (bits 8..24) the lower 16 bits of s from which the code is one more (0x10000:
     * none). At most one step falls within 16 bits of s, for either book (checked where they are built). */
    const uint32_t *steps_signed;
    const uint32_t *steps_unsigned;
    float lr, lr_wd, wd;        /* lr; lr * weight_decay (AdamW); weight_decay (Adam) */
    float w1, w2;               /* the lerp weights 1 - beta1 and 1 - beta2 */
    float bc1, bc2_sqrt, eps;   /* 1 - beta1^step, sqrt(1 - beta2^step), eps */
    int adamw, amsgrad, maximize;
    int fused;                  /* lerp with a fused multiply-add, as torch's vectorized kernel on this CPU */
    uint32_t key0, key1;        /* the stochastic rounding stream of this parameter at this step */
} ofl_adam_args;

/*
 * A step over elements [lo, hi) (lo a multiple of OFL_BLOCK) in two passes, with the square root between
 * them left to torch (its vectorized sqrt is not always correctly rounded, and must be the one used):
 *   ofl_adam_moments: the moments updated (and stored as codes), the fp32 values of exp_avg into m and of
 *     the second moment the denominator uses (max_exp_avg_sq with amsgrad) into second, from index 0;
 *   then root = torch.sqrt(second);
 *   ofl_adam_apply: the weights updated from m and root.
 * Each splits its range over up to `threads` threads. 0, or -EINVAL for bad arguments.
 */
int ofl_adam_moments(const ofl_adam_args *a, int64_t lo, int64_t hi, float *m, float *second, int threads);
int ofl_adam_apply(const ofl_adam_args *a, int64_t lo, int64_t hi, const float *m, const float *root, int threads);

/* dst[i] = src[i] rounded to bf16 stochastically with the stream (key0, key1) at element first + i. */
int ofl_round_bf16(const float *src, uint16_t *dst, int64_t n, int64_t first, uint32_t key0, uint32_t key1,
                   int threads);

/* The random 16 bits the stream (key0, key1) gives element `index` (for tests). */
uint32_t ofl_random16(uint32_t key0, uint32_t key1, int64_t index);
