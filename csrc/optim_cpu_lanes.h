/* The vector body of the C reference's Adam and SGD steps, written once for any lane count (optim_cpu.c includes it once per width). */
/* Before each inclusion optim_cpu.c defines LANES, VEC (the vector of LANES floats), VEC_INLINE and
   VEC_FN (the width's target attributes) and the lane operations: V_LOAD(dtype, base, i), V_STORE(dtype,
   base, i, x), V_SET1, V_ADD, V_SUB, V_MUL, V_DIV, V_FMADD(a, b, c) = a * b + c rounded once, V_SQRT,
   V_NEG (the sign bit flipped) and V_MAX_LT(old, next) = old < next ? next : old. Each inclusion makes
   adam_vector<LANES> and sgd_vector<LANES> (and the inline helpers they use), so the widths cannot
   drift apart: every lane does the scalar code's operations in its order (NOTE [ The C reference's
   vector path ]). No include guard. */

/* the gradient's lanes at element i as both updates take them: divided by grad_scale (`vscale`, as
   `scale_op` says), then negated when maximizing */
VEC_INLINE VEC WITH_LANES(gradient_lanes)(const int gd, uint64_t grad, int64_t i, VEC vscale, int scale_op,
                                          int maximize) {
    VEC g = V_LOAD(gd, grad, i);
    if (scale_op == SCALE_DIV)
        g = V_DIV(g, vscale);
    else if (scale_op == SCALE_MUL)
        g = V_MUL(g, vscale);
    if (maximize)
        g = V_NEG(g);
    return g;
}

/* hl_adam_element on elements [begin, begin + LANES * k) of one tensor, k as large as fits before
   `end`; returns where it stopped. `pd` and `gd` are constants where it is inlined (FOR_DTYPE_PAIR), so
   each dtype pair is its own loop. */
VEC_INLINE int64_t WITH_LANES(adam_lanes)(const int pd, const int gd, const hl_adam_scalars *s,
                                          const hl_adam_entry *e, int64_t begin, int64_t end, float scale,
                                          int scale_op) {
    const VEC vscale = V_SET1(scale);
    const VEC neg_lr_decay = V_SET1(-s->lr_decay), wd = V_SET1(s->weight_decay);
    const VEC b1 = V_SET1(s->beta1), neg_b1 = V_SET1(-s->beta1);
    const VEC b2 = V_SET1(s->beta2), neg_b2 = V_SET1(-s->beta2);
    const VEC bc2_sqrt = V_SET1(s->bc2_sqrt), eps = V_SET1(s->eps);
    const int bc2_mul = exact_reciprocal(s->bc2_sqrt);
    const VEC bc2_inv = V_SET1(1.0f / s->bc2_sqrt);
    const VEC step_size = V_SET1(s->step_size);
    const int decay = s->weight_decay != 0.0f, amsgrad = e->max_exp_avg_sq != 0;
    int64_t i = begin;
    for (; i + LANES <= end; i += LANES) {
        VEC g = WITH_LANES(gradient_lanes)(gd, e->grad, i, vscale, scale_op, s->maximize);
        VEC p = V_LOAD(pd, e->param, i);
        if (decay) {
            if (s->decoupled)
                p = V_FMADD(neg_lr_decay, p, p);
            else
                g = V_FMADD(p, wd, g);
        }
        const VEC m1 = V_FMADD(b1, V_LOAD(pd, e->exp_avg, i), V_FMADD(neg_b1, g, g));
        const VEC gg = V_MUL(g, g);
        const VEC v1 = V_FMADD(b2, V_LOAD(pd, e->exp_avg_sq, i), V_FMADD(neg_b2, gg, gg));
        VEC second = v1;
        if (amsgrad) {
            second = V_MAX_LT(V_LOAD(pd, e->max_exp_avg_sq, i), v1);
            V_STORE(pd, e->max_exp_avg_sq, i, second);
        }
        const VEC root = V_SQRT(second);
        const VEC denom = V_ADD(bc2_mul ? V_MUL(root, bc2_inv) : V_DIV(root, bc2_sqrt), eps);
        p = V_SUB(p, V_DIV(V_MUL(step_size, m1), denom));
        V_STORE(pd, e->param, i, p);
        V_STORE(pd, e->exp_avg, i, m1);
        V_STORE(pd, e->exp_avg_sq, i, v1);
    }
    return i;
}

VEC_FN int64_t WITH_LANES(adam_vector)(const hl_adam_scalars *s, const hl_adam_entry *e, int64_t begin, int64_t end,
                                       float scale, int scale_op) {
    return FOR_DTYPE_PAIR(e, WITH_LANES(adam_lanes), s, e, begin, end, scale, scale_op);
}

/* hl_sgd_element on LANES lanes, as adam_lanes */
VEC_INLINE int64_t WITH_LANES(sgd_lanes)(const int pd, const int gd, const hl_sgd_hyper *h, double lr,
                                         const hl_sgd_entry *e, int64_t begin, int64_t end, float scale,
                                         int scale_op) {
    const VEC vscale = V_SET1(scale);
    const float wd_f = (float)h->weight_decay;
    const VEC wd = V_SET1(wd_f), momentum = V_SET1((float)h->momentum);
    const VEC one_minus_dampening = V_SET1((float)h->one_minus_dampening);
    const VEC neg_lr = V_SET1(-(float)lr);
    const int has_buf = e->momentum_buffer != 0;
    int64_t i = begin;
    for (; i + LANES <= end; i += LANES) {
        VEC g = WITH_LANES(gradient_lanes)(gd, e->grad, i, vscale, scale_op, h->maximize);
        const VEC p = V_LOAD(pd, e->param, i);
        if (wd_f != 0.0f)
            g = V_FMADD(wd, p, g);
        if (has_buf) {
            const VEC b = h->first_step ? g
                                        : V_FMADD(one_minus_dampening, g,
                                                  V_MUL(momentum, V_LOAD(pd, e->momentum_buffer, i)));
            V_STORE(pd, e->momentum_buffer, i, b);
            g = h->nesterov ? V_FMADD(momentum, b, g) : b;
        }
        V_STORE(pd, e->param, i, V_FMADD(neg_lr, g, p));
    }
    return i;
}

VEC_FN int64_t WITH_LANES(sgd_vector)(const hl_sgd_hyper *h, double lr, const hl_sgd_entry *e, int64_t begin,
                                      int64_t end, float scale, int scale_op) {
    return FOR_DTYPE_PAIR(e, WITH_LANES(sgd_lanes), h, lr, e, begin, end, scale, scale_op);
}

/* the lane macros are the includer's, for this inclusion only */
#undef LANES
#undef VEC
#undef VEC_INLINE
#undef VEC_FN
#undef V_LOAD
#undef V_STORE
#undef V_SET1
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_DIV
#undef V_FMADD
#undef V_SQRT
#undef V_NEG
#undef V_MAX_LT
