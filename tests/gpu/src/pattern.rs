//! The memtest pattern: word `i` of generation `gen` is [`word`]`(i, seed, gen)`, written and
//! checked by the PTX kernels in [`PTX`], which compute the same function.

/// The 32-bit finaliser of MurmurHash3: a bijection that spreads every input bit.
pub const fn fmix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^= x >> 16;
    x
}

/// The expected value of word `i` (u32 words) for `seed` and generation `gen`.
pub const fn word(i: u64, seed: u32, gen_: u32) -> u32 {
    let lo = i as u32;
    let hi = (i >> 32) as u32;
    fmix32(lo ^ (seed ^ gen_.wrapping_mul(0x85eb_ca6b)) ^ hi.wrapping_mul(0xc2b2_ae35))
}

/// The checksum the verify kernel computes over `words`: the wrapping sum of
/// `words[i] * (2i + 1)`, which depends on every word and on its position.
pub fn checksum(words: &[u32], first_index: u64) -> u64 {
    words.iter().enumerate().fold(0u64, |acc, (k, &w)| {
        let i = first_index + k as u64;
        acc.wrapping_add(u64::from(w).wrapping_mul(i.wrapping_mul(2).wrapping_add(1)))
    })
}

/// Two kernels, both grid-stride loops over `n` u32 words at `buf`:
///
/// - `fill(buf, n, seed, gen)`: `buf[i] = word(i, seed, gen)`;
/// - `verify(buf, n, seed, gen, out)`: adds to `out[0]` the number of words that differ from
///   `word(i, seed, gen)`, lowers `out[1]` to the smallest such `i` (the host sets it to
///   `u64::MAX` first), and adds to `out[2]` the [`checksum`] of the thread's words.
///
/// PTX ISA 7.8 for `sm_80`: the driver JIT-compiles it for the GPU at hand (Hopper included).
pub const PTX: &str = r#"
.version 7.8
.target sm_80
.address_size 64

.visible .entry fill(
    .param .u64 p_buf,
    .param .u64 p_n,
    .param .u32 p_seed,
    .param .u32 p_gen
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
    ld.param.u32 %r1, [p_seed];
    ld.param.u32 %r2, [p_gen];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mul.wide.u32 %rd3, %r3, %r4;
    cvt.u64.u32 %rd4, %r5;
    add.u64 %rd3, %rd3, %rd4;
    mov.u32 %r6, %nctaid.x;
    mul.wide.u32 %rd5, %r6, %r4;
    mul.lo.u32 %r7, %r2, 0x85EBCA6B;
    xor.b32 %r7, %r7, %r1;
FILL_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra FILL_DONE;
    cvt.u32.u64 %r8, %rd3;
    shr.u64 %rd6, %rd3, 32;
    cvt.u32.u64 %r9, %rd6;
    mul.lo.u32 %r9, %r9, 0xC2B2AE35;
    xor.b32 %r10, %r8, %r7;
    xor.b32 %r10, %r10, %r9;
    shr.u32 %r11, %r10, 16;
    xor.b32 %r10, %r10, %r11;
    mul.lo.u32 %r10, %r10, 0x85EBCA6B;
    shr.u32 %r11, %r10, 13;
    xor.b32 %r10, %r10, %r11;
    mul.lo.u32 %r10, %r10, 0xC2B2AE35;
    shr.u32 %r11, %r10, 16;
    xor.b32 %r10, %r10, %r11;
    shl.b64 %rd7, %rd3, 2;
    add.u64 %rd8, %rd1, %rd7;
    st.global.u32 [%rd8], %r10;
    add.u64 %rd3, %rd3, %rd5;
    bra FILL_LOOP;
FILL_DONE:
    ret;
}

.visible .entry verify(
    .param .u64 p_buf,
    .param .u64 p_n,
    .param .u32 p_seed,
    .param .u32 p_gen,
    .param .u64 p_out
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<24>;

    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
    ld.param.u32 %r1, [p_seed];
    ld.param.u32 %r2, [p_gen];
    ld.param.u64 %rd10, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd10, %rd10;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mul.wide.u32 %rd3, %r3, %r4;
    cvt.u64.u32 %rd4, %r5;
    add.u64 %rd3, %rd3, %rd4;
    mov.u32 %r6, %nctaid.x;
    mul.wide.u32 %rd5, %r6, %r4;
    mul.lo.u32 %r7, %r2, 0x85EBCA6B;
    xor.b32 %r7, %r7, %r1;
    mov.u64 %rd11, 0;
    not.b64 %rd12, %rd11;
    mov.u64 %rd13, 0;
VERIFY_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra VERIFY_DONE;
    cvt.u32.u64 %r8, %rd3;
    shr.u64 %rd6, %rd3, 32;
    cvt.u32.u64 %r9, %rd6;
    mul.lo.u32 %r9, %r9, 0xC2B2AE35;
    xor.b32 %r10, %r8, %r7;
    xor.b32 %r10, %r10, %r9;
    shr.u32 %r11, %r10, 16;
    xor.b32 %r10, %r10, %r11;
    mul.lo.u32 %r10, %r10, 0x85EBCA6B;
    shr.u32 %r11, %r10, 13;
    xor.b32 %r10, %r10, %r11;
    mul.lo.u32 %r10, %r10, 0xC2B2AE35;
    shr.u32 %r11, %r10, 16;
    xor.b32 %r10, %r10, %r11;
    shl.b64 %rd7, %rd3, 2;
    add.u64 %rd8, %rd1, %rd7;
    ld.global.u32 %r12, [%rd8];
    setp.ne.u32 %p2, %r12, %r10;
    @%p2 add.u64 %rd11, %rd11, 1;
    @%p2 min.u64 %rd12, %rd12, %rd3;
    cvt.u64.u32 %rd14, %r12;
    shl.b64 %rd15, %rd3, 1;
    add.u64 %rd15, %rd15, 1;
    mad.lo.u64 %rd13, %rd14, %rd15, %rd13;
    add.u64 %rd3, %rd3, %rd5;
    bra VERIFY_LOOP;
VERIFY_DONE:
    red.global.add.u64 [%rd10], %rd11;
    red.global.min.u64 [%rd10+8], %rd12;
    red.global.add.u64 [%rd10+16], %rd13;
    ret;
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fmix32_known_values() {
        assert_eq!(fmix32(0), 0);
        // Reference values of MurmurHash3's fmix32.
        assert_eq!(fmix32(1), 0x514e_28b7);
        assert_eq!(fmix32(0xffff_ffff), 0x81f1_6f39);
    }

    #[test]
    fn words_depend_on_index_seed_and_generation() {
        let w = word(12345, 7, 0);
        assert_ne!(w, word(12346, 7, 0));
        assert_ne!(w, word(12345, 8, 0));
        assert_ne!(w, word(12345, 7, 1));
        assert_ne!(word(5, 7, 0), word(5 + (1 << 32), 7, 0), "the high half of the index counts");
    }

    #[test]
    fn checksum_depends_on_position() {
        let a = [1u32, 2, 3];
        let b = [2u32, 1, 3];
        assert_ne!(checksum(&a, 0), checksum(&b, 0));
        // 1*1 + 2*3 + 3*5
        assert_eq!(checksum(&a, 0), 22);
        // Split sums add up, as the kernel's per-thread partial sums do.
        assert_eq!(checksum(&a, 0), checksum(&a[..1], 0).wrapping_add(checksum(&a[1..], 1)));
    }

    #[test]
    fn ptx_has_both_kernels() {
        assert!(PTX.contains(".visible .entry fill("));
        assert!(PTX.contains(".visible .entry verify("));
    }
}
