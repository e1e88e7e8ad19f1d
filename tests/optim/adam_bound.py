"""A per-element bound on |hotloop's Adam - torch's fused Adam|, carried step by step along torch's own
trajectory, from the roundings each side makes and the betas each one uses.

Both sides start from the same parameters and see the same gradients (power-of-two scales unscale
exactly), so every difference comes from rounding. With u = 2**-24 (float32's unit roundoff) and, per
element, the reference's values before (m, v, p) and after (m', v', p') a step t, g the unscaled gradient
(plus weight_decay * p with Adam's coupled decay) and dg the bound on the two sides' difference in it, the
errors e_m, e_v, e_p (zero at first) grow, to first order in u, as
  e_m <- beta1 e_m + (1 - beta1) dg + k_m u (|m| + |g|) + r1 (|m| + |g|)
  e_v <- beta2 e_v + (1 - beta2)(2 |g| dg + dg^2) + k_v u (beta2 v + (1 - beta2) g^2) + r2 v + r2c g^2
  e_p <- e_p (1 - lr wd) + (2u + rd) |p|                                    (AdamW's decay)
         + min(step_size (e_m den + |m'| e_den) / (den (den - e_den)),     (the update's moment error,
               2 lr R)                                                      or two updates' worth)
         + 16 u |update| + 2u |p'|                                          (the update's own roundings)
(against torch's CPU kernel the update also moves by bc_err = t beta1^(t-1) |f32(beta1) - beta1| / (1 - beta1^t)
+ t beta2^(t-1) |f32(beta2) - beta2| / (2 (1 - beta2^t)) of itself: ours' bias corrections use float32 betas)
with den = sqrt(v')/bc2_sqrt + eps, e_den = e_v / (sqrt(v') + sqrt(max(v' - e_v, 0))) / bc2_sqrt (the
exact |sqrt(a) - sqrt(b)| = |a - b| / (sqrt(a) + sqrt(b))), amsgrad taking max_exp_avg_sq with
e_vmax <- max(e_vmax, e_v) (max moves by at most what moves its arguments). Rounding counts per step,
ours + torch's: ours is torch 2.11's CUDA arithmetic (kernels/optim_math.h): m' = fma(b1, m, fma(-b1, g, g))
rounds twice, v' = fma(b2, v, fma(-b2, g*g, g*g)) three times, with float32 betas. Against torch's CUDA
kernel (the same arithmetic and the same float32 betas: r = 0) k_m = 2 + 2, k_v = 3 + 3 (the two sides
agree bit for bit but where nvcc contracted differently). torch's CPU kernel is float: the moment lerp
m + (1 - beta1)(g - m) rounds twice and v * beta2 + (1 - beta2) * g * g four times (k_m = 2 + 3,
k_v = 3 + 5), and it uses float32's 1 - beta1, beta2, 1 - beta2 and 1 - lr wd; ours uses float32 beta1,
beta2 and lr * wd: the two sides' coefficients are off from the double values by r1 = |f32(1 - beta1) -
(1 - beta1)| + |f32(beta1) - beta1|, r2 = 2 |f32(beta2) - beta2|, r2c = |f32(1 - beta2) - (1 - beta2)| +
|f32(beta2) - beta2|, rd = |f32(1 - lr wd) - (1 - lr wd)| + |f32(f32(lr) f32(wd)) - lr wd|. The update's 16 u: each side rounds step_size, bc2_sqrt, sqrt, the division
by bc2_sqrt, + eps, the product with m and the quotient (7), plus slack; 2u |p'|: each side's final
subtraction. With coupled decay dg = wd e_p + 3u |g| (ours rounds g + wd p once, torch up to twice).
Where den - e_den <= 0 (coupled decay: g + wd p cancels to near 0, so the two sides' rounding of it may
give updates of different signs) the update's difference is bounded by two updates: Cauchy-Schwarz on
m = (1 - beta1) sum beta1^j g_j against v = (1 - beta2) sum beta2^j g_j^2 gives |update| <= lr R with
R = max(1, (1 - beta1) / sqrt((1 - beta2)(1 - beta1^2 / beta2))) (7.3 for the default betas; the bias
corrections keep the early steps' ratio near 1).
"""
import numpy as np
import torch

U = 2.0**-24


def _f32_error(x):
    return abs(float(np.float32(x)) - x)


class AdamBound:
    def __init__(self, params, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, torch_on_cuda, rel_g=0.0):
        """`torch_on_cuda`: the reference is torch's CUDA kernel (the same float arithmetic as ours);
        `rel_g`: a relative difference of the two sides' gradients (clipping), 0 when they are the same."""
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, beta1, beta2, eps, weight_decay
        self.decoupled, self.amsgrad, self.rel_g = decoupled, amsgrad, rel_g
        self.max_update = max(1.0, (1 - beta1) / ((1 - beta2) * (1 - beta1**2 / beta2)) ** 0.5)
        if torch_on_cuda:  # the same float betas, lr and weight_decay on both sides
            self.k_m, self.k_v, self.r1, self.r2, self.r2c, self.rd = 4, 6, 0.0, 0.0, 0.0, 0.0
        else:
            # ours: float32 beta1/beta2 (its 1 - beta is exact inside the fma, so off by beta's own error),
            # lr * weight_decay rounded from float32 lr and weight_decay; torch's CPU kernel: float32
            # 1 - beta1, beta2, 1 - beta2, 1 - lr wd
            b1, b2 = _f32_error(beta1), _f32_error(beta2)
            lr_wd = float(np.float32(np.float32(lr) * np.float32(weight_decay)))
            self.k_m, self.k_v = 5, 8
            self.r1, self.r2, self.r2c = _f32_error(1 - beta1) + b1, _f32_error(beta2) + b2, _f32_error(1 - beta2) + b2
            self.rd = _f32_error(1 - lr * weight_decay) + abs(lr_wd - lr * weight_decay)
        self.d1, self.d2 = (0.0, 0.0) if torch_on_cuda else (_f32_error(beta1), _f32_error(beta2))
        z = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        self.e_p, self.e_m, self.e_v, self.e_vmax = list(z), list(z), list(z), list(z)

    def step(self, t, grads, before, after):
        """One step taken (t: its number, from 1), with the reference's unscaled gradients and its
        (p, exp_avg, exp_avg_sq, max_exp_avg_sq or None) per parameter before and after."""
        b1, b2, lr, wd = self.b1, self.b2, self.lr, self.wd
        bc1, bc2s = 1 - b1**t, (1 - b2**t) ** 0.5
        step_size = lr / bc1
        # ours takes the bias corrections from float32 betas, torch's CPU kernel from double ones: the update
        # moves by t beta^(t-1) |dbeta| / (1 - beta^t) of itself (half that through bc2's square root)
        bc_err = t * b1 ** (t - 1) * self.d1 / (1 - b1**t) + t * b2 ** (t - 1) * self.d2 / (2 * (1 - b2**t))
        for i, (g, (p, m, v, _), (p1, m1, v1, vmax1)) in enumerate(zip(grads, before, after, strict=True)):
            g, p, m, v = g.double().abs(), p.double().abs(), m.double().abs(), v.double()
            p1, m1, v1 = p1.double(), m1.double().abs(), v1.double()
            e_p = self.e_p[i]
            dg = self.rel_g * g
            if wd != 0 and not self.decoupled:
                g = g + wd * p
                dg = dg + wd * e_p + 3 * U * g
            if wd != 0 and self.decoupled:
                e_p = e_p * (1 - lr * wd) + (2 * U + self.rd) * p
            self.e_m[i] = b1 * self.e_m[i] + (1 - b1) * dg + (self.k_m * U + self.r1) * (m + g)
            self.e_v[i] = b2 * self.e_v[i] + (1 - b2) * (2 * g * dg + dg * dg) + \
                self.k_v * U * (b2 * v + (1 - b2) * g * g) + self.r2 * v + self.r2c * g * g
            second, e_second = v1, self.e_v[i]
            if self.amsgrad:
                self.e_vmax[i] = torch.maximum(self.e_vmax[i], self.e_v[i])
                second, e_second = vmax1.double(), self.e_vmax[i]
            root = second.sqrt()
            den = root / bc2s + self.eps
            e_den = e_second / (root + (second - e_second).clamp(min=0).sqrt()).clamp(min=1e-300) / bc2s
            update = step_size * m1 / den
            two_updates = 2 * lr * self.max_update
            moved = step_size * (self.e_m[i] * den + m1 * e_den) / (den * (den - e_den))
            moved = torch.where(den > e_den, moved.clamp(max=two_updates), two_updates)
            e_p = e_p + moved + (16 * U + bc_err) * update + 2 * U * p1.abs()
            self.e_p[i] = e_p

    def check(self, ours, ref, ours_params, ref_params):
        """Every element of ours within the bound of torch's: parameters and moments."""
        for i, (p, q) in enumerate(zip(ours_params, ref_params, strict=True)):
            so, sr = ours.state[p], ref.state[q]
            pairs = [(p.detach(), q.detach(), self.e_p[i], "param"), (so["exp_avg"], sr["exp_avg"], self.e_m[i], "exp_avg"),
                     (so["exp_avg_sq"], sr["exp_avg_sq"], self.e_v[i], "exp_avg_sq")]
            if self.amsgrad:
                pairs.append((so["max_exp_avg_sq"], sr["max_exp_avg_sq"], self.e_vmax[i], "max_exp_avg_sq"))
            for a, b, bound, key in pairs:
                err = (a.double() - b.double()).abs()
                ok = err <= bound
                assert bool(ok.all()), (f"param {i} {key}: {int((~ok).sum())} elements beyond the bound, worst "
                                        f"{float((err / bound.clamp(min=1e-300)).max())} of it")


def state_of(opt, params):
    """(p, exp_avg, exp_avg_sq, max_exp_avg_sq or None) per parameter, copied"""
    out = []
    for p in params:
        st = opt.state.get(p, {})
        z = torch.zeros_like(p)
        out.append((p.detach().clone(), st.get("exp_avg", z).clone(), st.get("exp_avg_sq", z).clone(),
                    st["max_exp_avg_sq"].clone() if "max_exp_avg_sq" in st else None))
    return out
