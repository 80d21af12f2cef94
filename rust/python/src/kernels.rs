//! `paged_attention`: the `resin-kernels` CPU paged-attention kernel on numpy views of torch
//! tensors (the torch runner passes `tensor.numpy()`: no copy). Checks dtypes, shapes and
//! strides here and the plan's indices in the kernel, so a bad call is a `ValueError`, never a
//! wild read. The GIL is released while it runs. `openmp_team_available`: whether the kernels'
//! threads are torch's OpenMP team (`resin-kernels`' `openmp_team`) or threads of their own;
//! `kernels_vectorised`: whether they run their AVX2 path. `rotary_embedding`: the half-split
//! rotary embedding of q / k rows in one call (`resin-kernels`' `rotary`). `rms_norm`: HF's
//! RMSNorm of rows in one call (`resin-kernels`' `rms_norm`). `nucleus_cut`: where
//! rows' top-p nuclei end, the sort's cut without a sort (`resin-kernels`' `nucleus`).
//! `top_candidates`: each row's n largest logits, `topk`'s values (`resin-kernels`' `candidates`).
//! `linear`: `x @ w.T (+ bias)` for a decode step's few rows (`resin-kernels`' `linear`).

use numpy::{
    PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray1, PyReadwriteArray2,
    PyReadwriteArray3, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use resin_kernels::paged_attention::{Buffers, PagedAttention};
use resin_kernels::vector::{Ahead, Bf16, Element};

/// Element strides of `array`'s leading `N` axes; its last axis must be contiguous.
fn strides<const N: usize>(name: &str, byte_strides: &[isize], item: usize) -> PyResult<[isize; N]> {
    let item = item as isize;
    let last = byte_strides[byte_strides.len() - 1];
    if last != item || byte_strides.iter().any(|s| s % item != 0) {
        return Err(PyValueError::new_err(format!(
            "paged_attention: {name} needs a contiguous last axis (byte strides {byte_strides:?})"
        )));
    }
    let mut out = [0isize; N];
    for (o, s) in out.iter_mut().zip(byte_strides) {
        *o = s / item;
    }
    Ok(out)
}

fn slice<'a, T: numpy::Element>(name: &str, array: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    array.as_slice().map_err(|_| PyValueError::new_err(format!("paged_attention: {name} must be contiguous")))
}

/// The bytes `[start, end)` an array of `T` of `shape` and byte `strides` at `data` spans
/// (`None` when it holds no element).
fn byte_extent<T>(data: *const T, shape: &[usize], strides: &[isize]) -> Option<(isize, isize)> {
    if shape.contains(&0) {
        return None;
    }
    let (mut low, mut high) = (data as isize, data as isize);
    for (&n, &s) in shape.iter().zip(strides) {
        let reach = (n as isize - 1) * s;
        if reach < 0 {
            low += reach
        } else {
            high += reach
        }
    }
    Some((low, high + std::mem::size_of::<T>() as isize))
}

/// A ValueError naming the first array that is not C-contiguous (`as_slice` also takes Fortran
/// order, which a kernel reading rows would misread).
fn c_order<const N: usize>(kernel: &str, arrays: [(&str, bool); N]) -> PyResult<()> {
    match arrays.iter().find(|(_, c_order)| !c_order) {
        Some((name, _)) => Err(PyValueError::new_err(format!("{kernel}: {name} must be C-contiguous"))),
        None => Ok(()),
    }
}

/// A ValueError naming the first array whose address is not a multiple of its element's
/// alignment (a view at an odd offset, e.g. `np.frombuffer`, would be misaligned reads in Rust);
/// entries are (name, address, alignment), address 0 for an absent array.
fn aligned<const N: usize>(kernel: &str, arrays: [(&str, usize, usize); N]) -> PyResult<()> {
    match arrays.iter().find(|(_, address, align)| !address.is_multiple_of(*align)) {
        Some((name, _, align)) => {
            Err(PyValueError::new_err(format!("{kernel}: {name} must be aligned to its element ({align} bytes)")))
        }
        None => Ok(()),
    }
}

/// Whether `out`'s bytes (a [`byte_extent`]) meet any input's. numpy's borrow checker keys on
/// the base object, and every `tensor.numpy()` call makes a new one, so two views of one torch
/// tensor pass it; an `out` overlapping an input would be aliased `&` and `&mut` memory in Rust.
fn shares_bytes(out: Option<(isize, isize)>, inputs: impl IntoIterator<Item = Option<(isize, isize)>>) -> bool {
    let Some((o0, o1)) = out else { return false };
    inputs.into_iter().flatten().any(|(i0, i1)| o0 < i1 && i0 < o1)
}

/// `row(i)` for every `i` in `0..n`, the rows dealt out over up to `threads` threads of torch's
/// OpenMP team (at most one a row and one a core), every count-th row to one thread: callers'
/// rows come grouped by cost (the sampler's by kind), so contiguous parts would not balance.
/// `chunk(indices)` answers a thread's rows in order. `None` if a thread panicked.
fn on_row_threads(n: usize, threads: usize, chunk: &(dyn Fn(&[usize]) -> Vec<i64> + Sync)) -> Option<Vec<i64>> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = threads.min(n).min(cores).max(1);
    let parts = std::sync::Mutex::new(Vec::new());
    let ok = resin_kernels::openmp_team::run_parallel(threads, &|index, count| {
        let mine: Vec<usize> = (index..n).step_by(count).collect();
        let answers = chunk(&mine);
        parts.lock().unwrap_or_else(|e| e.into_inner()).push((mine, answers));
    });
    let mut out = vec![0i64; n];
    for (mine, answers) in parts.into_inner().unwrap_or_else(|e| e.into_inner()) {
        for (i, a) in mine.into_iter().zip(answers) {
            out[i] = a;
        }
    }
    ok.then_some(out)
}

/// A numpy slice of `T` read as kernel elements `E` of the same size (`f32` as itself, `i16`
/// as [`Bf16`] bits). The callers checked the array's C order and `E`'s alignment.
fn elements<E: Element, T: numpy::Element>(s: &[T]) -> &[E] {
    const { assert!(std::mem::size_of::<E>() == std::mem::size_of::<T>()) };
    // SAFETY: same size, alignment checked by the caller, and `T` is the type whose bits `E` reads.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const E, s.len()) }
}

/// [`elements`] of an output slice (exclusively borrowed; the callers checked it shares no byte
/// with an input).
fn elements_mut<E: Element, T: numpy::Element>(s: &mut [T]) -> &mut [E] {
    const { assert!(std::mem::size_of::<E>() == std::mem::size_of::<T>()) };
    // SAFETY: as for `elements`.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut E, s.len()) }
}

/// Attention of `q` [T, H, D] (f32) over the cache pages the plan lists (docs in
/// `resin-kernels`' `paged_attention`), written into `out` [T, H, value_dim]. `k_cache` /
/// `v_cache` are [pages, entries, kv_heads, dim] (strided views allowed, last axis
/// contiguous), both f32 or both int16 holding bfloat16 bits (numpy has no bfloat16: torch
/// passes `cache.view(torch.int16)`); `v_cache=None`: values are the key rows' first
/// `value_dim` channels. `bf16_rounding`: round scores and probabilities as a bfloat16 model's
/// eager attention does.
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, v_cache, out, query_indptr, seq_lens, kv_indptr, kv_indices, positions,
    *, scale, value_dim, window=None, ratio=1, softcap=None, sinks=None, threads=1, bf16_rounding=false
))]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, f32>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: Option<&Bound<'_, PyAny>>,
    out: PyReadwriteArray3<'_, f32>,
    query_indptr: PyReadonlyArray1<'_, u32>,
    seq_lens: PyReadonlyArray1<'_, u32>,
    kv_indptr: PyReadonlyArray1<'_, u32>,
    kv_indices: PyReadonlyArray1<'_, u32>,
    positions: PyReadonlyArray1<'_, i64>,
    scale: f32,
    value_dim: usize,
    window: Option<i64>,
    ratio: i64,
    softcap: Option<f32>,
    sinks: Option<PyReadonlyArray1<'_, f32>>,
    threads: usize,
    bf16_rounding: bool,
) -> PyResult<()> {
    let plan = Plan {
        query_indptr: &query_indptr,
        seq_lens: &seq_lens,
        kv_indptr: &kv_indptr,
        kv_indices: &kv_indices,
        positions: &positions,
        scale,
        value_dim,
        window,
        ratio,
        softcap,
        sinks: sinks.as_ref(),
        threads,
        bf16_rounding,
    };
    if let Ok(k) = k_cache.extract::<PyReadonlyArray4<'_, f32>>() {
        let v = v_cache
            .map(|v| v.extract::<PyReadonlyArray4<'_, f32>>())
            .transpose()
            .map_err(|_| PyValueError::new_err("paged_attention: v_cache must have k_cache's dtype (float32)"))?;
        return attend::<f32, f32>(py, &q, &k, v.as_ref(), out, &plan);
    }
    if let Ok(k) = k_cache.extract::<PyReadonlyArray4<'_, i16>>() {
        let v = v_cache
            .map(|v| v.extract::<PyReadonlyArray4<'_, i16>>())
            .transpose()
            .map_err(|_| PyValueError::new_err("paged_attention: v_cache must have k_cache's dtype (int16: bfloat16 bits)"))?;
        return attend::<Bf16, i16>(py, &q, &k, v.as_ref(), out, &plan);
    }
    Err(PyValueError::new_err("paged_attention: k_cache must be a 4-d float32 array or int16 (bfloat16 bits)"))
}

/// `paged_attention`'s plan arrays and settings, whatever the cache's element type.
struct Plan<'a, 'py> {
    query_indptr: &'a PyReadonlyArray1<'py, u32>,
    seq_lens: &'a PyReadonlyArray1<'py, u32>,
    kv_indptr: &'a PyReadonlyArray1<'py, u32>,
    kv_indices: &'a PyReadonlyArray1<'py, u32>,
    positions: &'a PyReadonlyArray1<'py, i64>,
    scale: f32,
    value_dim: usize,
    window: Option<i64>,
    ratio: i64,
    softcap: Option<f32>,
    sinks: Option<&'a PyReadonlyArray1<'py, f32>>,
    threads: usize,
    bf16_rounding: bool,
}

/// `paged_attention` over a cache of `E` elements, stored as numpy `T` (the same size).
fn attend<E: Element, T: numpy::Element>(
    py: Python<'_>,
    q: &PyReadonlyArray3<'_, f32>,
    k_cache: &PyReadonlyArray4<'_, T>,
    v_cache: Option<&PyReadonlyArray4<'_, T>>,
    mut out: PyReadwriteArray3<'_, f32>,
    plan: &Plan<'_, '_>,
) -> PyResult<()> {
    const { assert!(std::mem::size_of::<E>() == std::mem::size_of::<T>()) };
    let item = std::mem::size_of::<E>();
    let value_dim = plan.value_dim;
    let (qs, ks, os) = (q.shape().to_vec(), k_cache.shape().to_vec(), out.shape().to_vec());
    let vs = v_cache.map_or(ks.clone(), |v| v.shape().to_vec());
    let (num_tokens, num_heads, head_dim) = (qs[0], qs[1], qs[2]);
    let bad = |what: String| Err(PyValueError::new_err(format!("paged_attention: {what}")));
    if ks[3] != head_dim {
        return bad(format!("q {qs:?} and k_cache {ks:?} disagree on the key width"));
    }
    if vs[0] != ks[0] || vs[1] != ks[1] || vs[2] != ks[2] || vs[3] < value_dim {
        return bad(format!("v_cache {vs:?} does not hold {value_dim}-wide values for k_cache {ks:?}"));
    }
    if os != [num_tokens, num_heads, value_dim] {
        return bad(format!("out is {os:?}, expected [{num_tokens}, {num_heads}, {value_dim}]"));
    }
    aligned(
        "paged_attention",
        [
            ("q", q.data() as usize, std::mem::align_of::<f32>()),
            ("k_cache", k_cache.data() as usize, std::mem::align_of::<E>()),
            ("v_cache", v_cache.map_or(0, |v| v.data() as usize), std::mem::align_of::<E>()),
            ("out", out.data() as usize, std::mem::align_of::<f32>()),
        ],
    )?;
    let q_strides = strides::<2>("q", q.strides(), 4)?;
    let k_strides = strides::<3>("k_cache", k_cache.strides(), item)?;
    let v_strides = match v_cache {
        Some(v) => strides::<3>("v_cache", v.strides(), item)?,
        None => k_strides,
    };
    let out_strides = strides::<2>("out", out.strides(), 4)?;
    let sink_values = match plan.sinks {
        Some(s) => Some(slice("sinks", s)?),
        None => None,
    };
    let att = PagedAttention {
        query_indptr: slice("query_indptr", plan.query_indptr)?,
        seq_lens: slice("seq_lens", plan.seq_lens)?,
        kv_indptr: slice("kv_indptr", plan.kv_indptr)?,
        kv_indices: slice("kv_indices", plan.kv_indices)?,
        positions: slice("positions", plan.positions)?,
        page_entries: ks[1],
        window: plan.window,
        ratio: plan.ratio,
        num_heads,
        num_kv_heads: ks[2],
        head_dim,
        value_dim,
        scale: plan.scale,
        softcap: plan.softcap,
        sinks: sink_values,
        bf16_rounding: plan.bf16_rounding,
    };
    let k_data = k_cache.data() as *const E;
    let buffers = Buffers::<E> {
        q: q.data(),
        q_strides,
        k: k_data,
        k_strides,
        v: v_cache.map_or(k_data, |v| v.data() as *const E),
        v_strides,
        out: out.as_array_mut().as_mut_ptr(),
        out_strides,
        num_tokens,
        num_pages: ks[0],
    };
    let inputs = [
        byte_extent(q.data(), &qs, q.strides()),
        byte_extent(k_cache.data(), &ks, k_cache.strides()),
        v_cache.and_then(|v| byte_extent(v.data(), &vs, v.strides())),
    ];
    if shares_bytes(byte_extent(buffers.out, &os, out.strides()), inputs) {
        return bad("out must not overlap q, k_cache or v_cache".to_string());
    }
    let threads = plan.threads;
    // SAFETY: every pointer is a live numpy array of the checked shape and strides (`E` and
    // `T` of one size), and `out` shares no byte with an input (checked just above).
    py.detach(|| unsafe { att.run(&buffers, threads) }).map_err(|e| PyValueError::new_err(format!("paged_attention: {e}")))
}

/// Whether `paged_attention`'s threads run as a parallel region of the process's OpenMP team
/// (torch's, looked up among the process's loaded libraries); False: threads of its own, which compete
/// with torch's spinning workers for the cores.
#[pyfunction]
pub fn openmp_team_available() -> bool {
    resin_kernels::openmp_team::available()
}

/// Whether the kernels run vectorised on this CPU (x86-64 with AVX2 + FMA); False: their scalar
/// fallback, which the torch backend does not use by default.
#[pyfunction]
pub fn kernels_vectorised() -> bool {
    resin_kernels::vector::vectorised()
}

/// `out = x * cos + rotate_half(x) * sin` for `x` [T, H, D] and per-token tables `cos` / `sin`
/// [T, D] (C-contiguous, all float32 or all int16 holding bfloat16 bits; `out` shaped as `x`):
/// `resin-kernels`' `rotary`, torch's floats bit for bit. Runs on the calling thread, GIL held
/// (a step's rows are microseconds).
#[pyfunction]
pub fn rotary_embedding(
    x: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    if let Ok(x) = x.extract::<PyReadonlyArray3<'_, f32>>() {
        return rotate::<f32, f32>(x, cos, sin, out, "float32");
    }
    if let Ok(x) = x.extract::<PyReadonlyArray3<'_, i16>>() {
        return rotate::<Bf16, i16>(x, cos, sin, out, "int16 (bfloat16 bits)");
    }
    Err(PyValueError::new_err("rotary_embedding: x must be a 3-d float32 array or int16 (bfloat16 bits)"))
}

/// `rotary_embedding` with every operand of numpy type `T`, read as kernel element `E`.
fn rotate<E: Element, T: numpy::Element>(
    x: PyReadonlyArray3<'_, T>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
) -> PyResult<()> {
    let bad = |what: String| PyValueError::new_err(format!("rotary_embedding: {what}"));
    let same = |name: &str| bad(format!("{name} must be a {dtype} array of its documented rank, like x (out writable)"));
    let cos = cos.extract::<PyReadonlyArray2<'_, T>>().map_err(|_| same("cos"))?;
    let sin = sin.extract::<PyReadonlyArray2<'_, T>>().map_err(|_| same("sin"))?;
    let mut out = out.extract::<PyReadwriteArray3<'_, T>>().map_err(|_| same("out"))?;
    let (xs, cs, ss, os) = (x.shape().to_vec(), cos.shape().to_vec(), sin.shape().to_vec(), out.shape().to_vec());
    if cs != [xs[0], xs[2]] || ss != cs || os != xs {
        return Err(bad(format!("x {xs:?}, cos {cs:?}, sin {ss:?} and out {os:?} do not agree (x [T, H, D], tables [T, D])")));
    }
    if !xs[2].is_multiple_of(2) || xs.contains(&0) {
        return Err(bad(format!("x {xs:?} needs an even, non-zero head_dim and no empty axis")));
    }
    c_order(
        "rotary_embedding",
        [
            ("x", x.is_c_contiguous()),
            ("cos", cos.is_c_contiguous()),
            ("sin", sin.is_c_contiguous()),
            ("out", out.is_c_contiguous()),
        ],
    )?;
    let align = std::mem::align_of::<E>();
    aligned(
        "rotary_embedding",
        [
            ("x", x.data() as usize, align),
            ("cos", cos.data() as usize, align),
            ("sin", sin.data() as usize, align),
            ("out", out.data() as usize, align),
        ],
    )?;
    let inputs = [
        byte_extent(x.data(), &xs, x.strides()),
        byte_extent(cos.data(), &cs, cos.strides()),
        byte_extent(sin.data(), &ss, sin.strides()),
    ];
    if shares_bytes(byte_extent(out.data(), &os, out.strides()), inputs) {
        return Err(bad("out must not overlap x, cos or sin".to_string()));
    }
    // C order and alignment were checked above.
    let not_c = |_| bad("arrays must be C-contiguous".to_string());
    let (xv, cv, sv) = (x.as_slice().map_err(not_c)?, cos.as_slice().map_err(not_c)?, sin.as_slice().map_err(not_c)?);
    let ov = elements_mut::<E, T>(out.as_slice_mut().map_err(not_c)?);
    resin_kernels::rotary::rotate_half_split(elements(xv), elements(cv), elements(sv), ov, xs[2]);
    Ok(())
}

/// `out = weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)` over each row of `x` [rows, D]
/// (HF's `LlamaRMSNorm`), `weight` [D], `out` shaped as `x`; C-contiguous, all float32 or all
/// int16 holding bfloat16 bits; D >= 8. `resin-kernels`' `rms_norm`: torch's floats bit for bit,
/// the mean summed in torch's order. Runs on the calling thread, GIL held.
#[pyfunction]
pub fn rms_norm(x: &Bound<'_, PyAny>, weight: &Bound<'_, PyAny>, eps: f32, out: &Bound<'_, PyAny>) -> PyResult<()> {
    if let Ok(x) = x.extract::<PyReadonlyArray2<'_, f32>>() {
        return normalise::<f32, f32>(x, weight, eps, out, "float32");
    }
    if let Ok(x) = x.extract::<PyReadonlyArray2<'_, i16>>() {
        return normalise::<Bf16, i16>(x, weight, eps, out, "int16 (bfloat16 bits)");
    }
    Err(PyValueError::new_err("rms_norm: x must be a 2-d float32 array or int16 (bfloat16 bits)"))
}

/// `rms_norm` with every operand of numpy type `T`, read as kernel element `E`.
fn normalise<E: Element, T: numpy::Element>(
    x: PyReadonlyArray2<'_, T>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
    dtype: &str,
) -> PyResult<()> {
    let bad = |what: String| PyValueError::new_err(format!("rms_norm: {what}"));
    let same = |name: &str| bad(format!("{name} must be a {dtype} array of its documented rank, like x (out writable)"));
    let weight = weight.extract::<PyReadonlyArray1<'_, T>>().map_err(|_| same("weight"))?;
    let mut out = out.extract::<PyReadwriteArray2<'_, T>>().map_err(|_| same("out"))?;
    let (xs, ws, os) = (x.shape().to_vec(), weight.shape().to_vec(), out.shape().to_vec());
    if ws != [xs[1]] || os != xs {
        return Err(bad(format!("x {xs:?}, weight {ws:?} and out {os:?} do not agree (x [rows, D], weight [D])")));
    }
    if xs[1] < 8 || xs[0] == 0 {
        return Err(bad(format!("x {xs:?} needs rows of at least 8 elements and at least one row")));
    }
    if !eps.is_finite() || eps < 0.0 {
        return Err(bad(format!("eps {eps} must be finite and not negative")));
    }
    c_order("rms_norm", [("x", x.is_c_contiguous()), ("weight", weight.is_c_contiguous()), ("out", out.is_c_contiguous())])?;
    let align = std::mem::align_of::<E>();
    aligned(
        "rms_norm",
        [("x", x.data() as usize, align), ("weight", weight.data() as usize, align), ("out", out.data() as usize, align)],
    )?;
    let inputs = [byte_extent(x.data(), &xs, x.strides()), byte_extent(weight.data(), &ws, weight.strides())];
    if shares_bytes(byte_extent(out.data(), &os, out.strides()), inputs) {
        return Err(bad("out must not overlap x or weight".to_string()));
    }
    // C order and alignment were checked above.
    let not_c = |_| bad("arrays must be C-contiguous".to_string());
    let (xv, wv) = (x.as_slice().map_err(not_c)?, weight.as_slice().map_err(not_c)?);
    let ov = elements_mut::<E, T>(out.as_slice_mut().map_err(not_c)?);
    resin_kernels::rms_norm::rms_norm(elements(xv), elements(wv), eps, ov);
    Ok(())
}

/// For each row `rows[i]` of `logits` / `probs` [N, V] (f32, C-contiguous; scaled logits and
/// their softmax): the logit where its top-p nucleus of mass `top_p[i]` ends, into `threshold[i]`,
/// and its C largest logits (descending) and their columns into `top_values` / `top_indices`
/// [n, C] (`resin-kernels`' `nucleus`: torch's sort-and-cumsum cut, bit for bit). GIL released.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn nucleus_cut(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    probs: PyReadonlyArray2<'_, f32>,
    rows: PyReadonlyArray1<'_, i64>,
    top_p: PyReadonlyArray1<'_, f32>,
    mut threshold: PyReadwriteArray1<'_, f32>,
    mut top_values: PyReadwriteArray2<'_, f32>,
    mut top_indices: PyReadwriteArray2<'_, i64>,
) -> PyResult<()> {
    let (ls, ps, vs, is) =
        (logits.shape().to_vec(), probs.shape().to_vec(), top_values.shape().to_vec(), top_indices.shape().to_vec());
    let n = rows.len();
    let bad = |what: String| Err(PyValueError::new_err(format!("nucleus_cut: {what}")));
    if ps != ls
        || ls[1] == 0
        || ls[1] >= 1 << 32
        || top_p.len() != n
        || threshold.len() != n
        || vs[0] != n
        || is != vs
        || vs[1] > ls[1]
    {
        return bad(format!(
            "logits {ls:?}, probs {ps:?}, rows [{n}], top_p [{}], threshold [{}], top_values {vs:?} and \
             top_indices {is:?} do not agree (logits / probs [N, 0 < V < 2^32], rows [n], outputs [n] and [n, C <= V])",
            top_p.len(),
            threshold.len()
        ));
    }
    c_order(
        "nucleus_cut",
        [
            ("logits", logits.is_c_contiguous()),
            ("probs", probs.is_c_contiguous()),
            ("top_values", top_values.is_c_contiguous()),
            ("top_indices", top_indices.is_c_contiguous()),
        ],
    )?;
    let not_c = |_| PyValueError::new_err("nucleus_cut: arrays must be contiguous");
    let row_list = rows.as_slice().map_err(not_c)?;
    if let Some(&row) = row_list.iter().find(|&&r| r < 0 || r as usize >= ls[0]) {
        return bad(format!("row {row} is not a row of logits {ls:?}"));
    }
    let inputs = [
        byte_extent(logits.data(), &ls, logits.strides()),
        byte_extent(probs.data(), &ps, probs.strides()),
        byte_extent(top_p.data(), &[n], top_p.strides()),
        byte_extent(rows.data(), &[n], rows.strides()),
    ];
    let outputs = [
        byte_extent(threshold.data(), &[n], threshold.strides()),
        byte_extent(top_values.data(), &vs, top_values.strides()),
        byte_extent(top_indices.data(), &is, top_indices.strides()),
    ];
    let all_but =
        |skip: usize| inputs.iter().chain(outputs.iter().enumerate().filter(move |(i, _)| *i != skip).map(|(_, o)| o)).copied();
    if (0..outputs.len()).any(|i| shares_bytes(outputs[i], all_but(i))) {
        return bad("the outputs must not overlap each other or an input (rows included)".to_string());
    }
    let (logit_rows, prob_rows) = (logits.as_slice().map_err(not_c)?, probs.as_slice().map_err(not_c)?);
    let masses = top_p.as_slice().map_err(not_c)?;
    let (thresholds, values, indices) = (
        threshold.as_slice_mut().map_err(not_c)?,
        top_values.as_slice_mut().map_err(not_c)?,
        top_indices.as_slice_mut().map_err(not_c)?,
    );
    let (vocab_size, width) = (ls[1], vs[1]);
    py.detach(|| {
        let mut scratch = resin_kernels::nucleus::NucleusScratch::default();
        for (i, &row) in row_list.iter().enumerate() {
            let span = row as usize * vocab_size..(row as usize + 1) * vocab_size;
            thresholds[i] = resin_kernels::nucleus::nucleus_cut(
                &logit_rows[span.clone()],
                &prob_rows[span],
                masses[i],
                &mut values[i * width..(i + 1) * width],
                &mut indices[i * width..(i + 1) * width],
                &mut scratch,
            );
        }
    });
    Ok(())
}

/// Each row's inverse-CDF token into `tokens` [S] (int64): the first column of `probs` [S, V]
/// (f32, C-contiguous) whose float32 cumulative sum exceeds `uniforms[r]` (f32 [S]) times the
/// row's total (`resin-kernels`' `draw`: torch's `cumsum` + `searchsorted`, bit for bit); -1
/// for a row whose total is not positive and finite (the caller draws it). GIL released.
#[pyfunction]
pub fn inverse_cdf(
    py: Python<'_>,
    probs: PyReadonlyArray2<'_, f32>,
    uniforms: PyReadonlyArray1<'_, f32>,
    mut tokens: PyReadwriteArray1<'_, i64>,
) -> PyResult<()> {
    let (ps, us, ts) = (probs.shape().to_vec(), uniforms.shape().to_vec(), tokens.shape().to_vec());
    if us[0] != ps[0] || ts[0] != ps[0] || ps[1] == 0 {
        return Err(PyValueError::new_err(format!(
            "inverse_cdf: probs {ps:?}, uniforms {us:?} and tokens {ts:?} do not agree ([S, V > 0], [S], [S])"
        )));
    }
    c_order(
        "inverse_cdf",
        [("probs", probs.is_c_contiguous()), ("uniforms", uniforms.is_c_contiguous()), ("tokens", tokens.is_c_contiguous())],
    )?;
    let inputs = [byte_extent(probs.data(), &ps, probs.strides()), byte_extent(uniforms.data(), &us, uniforms.strides())];
    if shares_bytes(byte_extent(tokens.data(), &ts, tokens.strides()), inputs) {
        return Err(PyValueError::new_err("inverse_cdf: tokens must not overlap probs or uniforms"));
    }
    let not_c = |_| PyValueError::new_err("inverse_cdf: arrays must be contiguous and aligned");
    let (rows, us) = (probs.as_slice().map_err(not_c)?, uniforms.as_slice().map_err(not_c)?);
    let out = tokens.as_slice_mut().map_err(not_c)?;
    let drawn = py.detach(|| resin_kernels::draw::draw_rows(rows, ps[1], us, &mut Vec::new()));
    for (token, d) in out.iter_mut().zip(drawn) {
        *token = d.map_or(-1, |t| t as i64);
    }
    Ok(())
}

/// Each row's greedy token into `tokens` [S] (int64): the first column of the row's largest
/// logit of `logits` [S, V] (f32, C-contiguous), a NaN the largest (`resin-kernels`' `argmax`:
/// torch's `argmax`, column for column). With `rows` (int64 [n]), token i is row `rows[i]`'s
/// and `tokens` is [n] (`logits` [R, V] read in place, no copy of the rows picked). GIL
/// released; the rows dealt out over `threads` threads of torch's OpenMP team.
#[pyfunction]
#[pyo3(signature = (logits, tokens, *, rows=None, threads=1))]
pub fn argmax(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    mut tokens: PyReadwriteArray1<'_, i64>,
    rows: Option<PyReadonlyArray1<'_, i64>>,
    threads: usize,
) -> PyResult<()> {
    let (ls, ts) = (logits.shape().to_vec(), tokens.shape().to_vec());
    let n = rows.as_ref().map_or(ls[0], |r| r.len());
    if ts[0] != n || ls[1] == 0 {
        let wanted = if rows.is_some() { "[R, V > 0], [n] as rows" } else { "[S, V > 0], [S]" };
        return Err(PyValueError::new_err(format!("argmax: logits {ls:?} and tokens {ts:?} do not agree ({wanted})")));
    }
    c_order("argmax", [("logits", logits.is_c_contiguous()), ("tokens", tokens.is_c_contiguous())])?;
    let input = [byte_extent(logits.data(), &ls, logits.strides())];
    if shares_bytes(byte_extent(tokens.data(), &ts, tokens.strides()), input) {
        return Err(PyValueError::new_err("argmax: tokens must not overlap logits"));
    }
    let not_c = |_| PyValueError::new_err("argmax: arrays must be contiguous and aligned");
    let picked_rows: Vec<usize> = match &rows {
        None => (0..n).collect(),
        Some(r) => {
            let list = r.as_slice().map_err(not_c)?;
            if let Some(&bad) = list.iter().find(|&&r| r < 0 || r as usize >= ls[0]) {
                return Err(PyValueError::new_err(format!("argmax: row {bad} is not a row of logits {ls:?}")));
            }
            list.iter().map(|&r| r as usize).collect()
        }
    };
    let all = logits.as_slice().map_err(not_c)?;
    let out = tokens.as_slice_mut().map_err(not_c)?;
    let width = ls[1];
    let picked = py.detach(|| {
        on_row_threads(n, threads, &|mine| {
            mine.iter()
                .enumerate()
                .map(|(k, &i)| {
                    let row = |r: usize| &all[r * width..(r + 1) * width];
                    // The next row of this thread's is asked for as this one is read.
                    let mut next = mine.get(k + 1).map_or(Ahead::none(), |&j| {
                        let next = row(picked_rows[j]);
                        Ahead::new(next.as_ptr() as *const u8, std::mem::size_of_val(next))
                    });
                    resin_kernels::argmax::argmax(row(picked_rows[i]), &mut next) as i64
                })
                .collect()
        })
    });
    let Some(picked) = picked else {
        return Err(PyValueError::new_err("argmax: the kernel panicked on a thread"));
    };
    out.copy_from_slice(&picked);
    Ok(())
}

/// The `values.shape[1]` = n largest logits of each row of `logits` [S, V] (f32, C-contiguous),
/// descending, into `values` [S, n] and their columns into `indices` [S, n] (`resin-kernels`'
/// `candidates`: `topk(n)`'s values exactly). GIL released.
#[pyfunction]
pub fn top_candidates(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    mut values: PyReadwriteArray2<'_, f32>,
    mut indices: PyReadwriteArray2<'_, i64>,
) -> PyResult<()> {
    let (ls, vs, is) = (logits.shape().to_vec(), values.shape().to_vec(), indices.shape().to_vec());
    let bad = |what: String| Err(PyValueError::new_err(format!("top_candidates: {what}")));
    if vs[0] != ls[0] || is != vs || vs[1] > ls[1] || ls[1] >= 1 << 32 {
        return bad(format!("logits {ls:?}, values {vs:?} and indices {is:?} do not agree ([S, V], [S, n <= V] each)"));
    }
    c_order(
        "top_candidates",
        [("logits", logits.is_c_contiguous()), ("values", values.is_c_contiguous()), ("indices", indices.is_c_contiguous())],
    )?;
    let input = [byte_extent(logits.data(), &ls, logits.strides())];
    let (value_bytes, index_bytes) =
        (byte_extent(values.data(), &vs, values.strides()), byte_extent(indices.data(), &is, indices.strides()));
    if shares_bytes(value_bytes, input) || shares_bytes(index_bytes, input) || shares_bytes(value_bytes, [index_bytes]) {
        return bad("values and indices must not overlap each other or logits".to_string());
    }
    let not_c = |_| PyValueError::new_err("top_candidates: arrays must be contiguous");
    let rows = logits.as_slice().map_err(not_c)?;
    let (out_values, out_indices) = (values.as_slice_mut().map_err(not_c)?, indices.as_slice_mut().map_err(not_c)?);
    let (vocab_size, n) = (ls[1], vs[1]);
    if n == 0 {
        return Ok(());
    }
    py.detach(|| {
        let mut buffer = Vec::new();
        let all_rows: Vec<&[f32]> = rows.chunks_exact(vocab_size).collect();
        for (r, (v, i)) in out_values.chunks_exact_mut(n).zip(out_indices.chunks_exact_mut(n)).enumerate() {
            // The next row is asked for as this one is read.
            let mut next = all_rows
                .get(r + 1)
                .map_or(Ahead::none(), |next| Ahead::new(next.as_ptr() as *const u8, std::mem::size_of_val(*next)));
            resin_kernels::candidates::largest(all_rows[r], v, i, &mut buffer, &mut next);
        }
    });
    Ok(())
}

/// `out = x @ w.T (+ bias)` for a few rows: `x` [rows, in], `w` [out_features, in], `bias`
/// [out_features] or None, `out` [rows, out_features], all C-contiguous and of one dtype:
/// float32, or int16 holding bfloat16 bits (torch passes `t.view(torch.int16)`). Each output
/// is one float32 dot product plus the bias, rounded once (`resin-kernels`' `linear`: torch's
/// math in another summation order). GIL released; `threads` on torch's OpenMP team.
#[pyfunction]
#[pyo3(signature = (x, w, bias, out, *, threads=1))]
pub fn linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    if let Ok(x) = x.extract::<PyReadonlyArray2<'_, f32>>() {
        return project::<f32, f32>(py, x, w, bias, out, threads, "float32");
    }
    if let Ok(x) = x.extract::<PyReadonlyArray2<'_, i16>>() {
        return project::<Bf16, i16>(py, x, w, bias, out, threads, "int16 (bfloat16 bits)");
    }
    Err(PyValueError::new_err("linear: x must be a 2-d float32 array or int16 (bfloat16 bits)"))
}

/// `linear` with every operand of numpy type `T`, read as kernel element `E` (the same size).
fn project<E: Element + Send + Sync, T: numpy::Element>(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, T>,
    w: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let bad = |what: String| PyValueError::new_err(format!("linear: {what}"));
    let same = |name: &str| {
        bad(format!("{name} must be a {dtype} array of its documented rank, like x (and out writable, borrowed nowhere else)"))
    };
    let w = w.extract::<PyReadonlyArray2<'_, T>>().map_err(|_| same("w"))?;
    let bias = bias.map(|b| b.extract::<PyReadonlyArray1<'_, T>>()).transpose().map_err(|_| same("bias"))?;
    let mut out = out.extract::<PyReadwriteArray2<'_, T>>().map_err(|_| same("out"))?;
    let (xs, ws, os) = (x.shape().to_vec(), w.shape().to_vec(), out.shape().to_vec());
    if xs[1] == 0 || ws[1] != xs[1] || os != [xs[0], ws[0]] {
        return Err(bad(format!("x {xs:?}, w {ws:?} and out {os:?} do not agree (x [rows, in], w [out, in], out [rows, out])")));
    }
    if let Some(b) = &bias {
        if b.shape() != [ws[0]] {
            return Err(bad(format!("bias is {:?}, expected [{}]", b.shape(), ws[0])));
        }
    }
    c_order(
        "linear",
        [
            ("x", x.is_c_contiguous()),
            ("w", w.is_c_contiguous()),
            ("bias", bias.as_ref().is_none_or(|b| b.is_c_contiguous())),
            ("out", out.is_c_contiguous()),
        ],
    )?;
    let align = std::mem::align_of::<E>();
    aligned(
        "linear",
        [
            ("x", x.data() as usize, align),
            ("w", w.data() as usize, align),
            ("bias", bias.as_ref().map_or(0, |b| b.data() as usize), align),
            ("out", out.data() as usize, align),
        ],
    )?;
    let inputs = [
        byte_extent(x.data(), &xs, x.strides()),
        byte_extent(w.data(), &ws, w.strides()),
        bias.as_ref().and_then(|b| byte_extent(b.data(), b.shape(), b.strides())),
    ];
    if shares_bytes(byte_extent(out.data(), &os, out.strides()), inputs) {
        return Err(bad("out must not overlap x, w or bias".to_string()));
    }
    let in_features = xs[1];
    // C order and alignment were checked above.
    let not_c = |_| bad("arrays must be C-contiguous".to_string());
    let (x_slice, w_slice) = (elements::<E, T>(x.as_slice().map_err(not_c)?), elements::<E, T>(w.as_slice().map_err(not_c)?));
    let bias_slice = match &bias {
        Some(b) => Some(elements::<E, T>(b.as_slice().map_err(not_c)?)),
        None => None,
    };
    let out_e = elements_mut::<E, T>(out.as_slice_mut().map_err(not_c)?);
    py.detach(|| resin_kernels::linear::linear(x_slice, w_slice, bias_slice, out_e, in_features, threads));
    Ok(())
}

/// torch's `softmax(dim=-1)` of each row of `x` [S, V] (f32, C-contiguous) into `out` [S, V],
/// bit for bit where `lanes` (8 or 16) is torch's float vector width (`resin-kernels`'
/// `softmax`); the sampler's probe compares the two. GIL released.
#[pyfunction]
pub fn softmax(py: Python<'_>, x: PyReadonlyArray2<'_, f32>, lanes: usize, mut out: PyReadwriteArray2<'_, f32>) -> PyResult<()> {
    let (xs, os) = (x.shape().to_vec(), out.shape().to_vec());
    let Some(lanes) = resin_kernels::softmax::Lanes::new(lanes) else {
        return Err(PyValueError::new_err(format!("softmax: lanes must be 8 or 16, not {lanes}")));
    };
    if xs != os || xs[1] == 0 {
        return Err(PyValueError::new_err(format!("softmax: x {xs:?} and out {os:?} do not agree ([S, V > 0] both)")));
    }
    c_order("softmax", [("x", x.is_c_contiguous()), ("out", out.is_c_contiguous())])?;
    if shares_bytes(byte_extent(out.data(), &os, out.strides()), [byte_extent(x.data(), &xs, x.strides())]) {
        return Err(PyValueError::new_err("softmax: out must not overlap x"));
    }
    let not_c = |_| PyValueError::new_err("softmax: arrays must be contiguous and aligned");
    let (rows, outs) = (x.as_slice().map_err(not_c)?, out.as_slice_mut().map_err(not_c)?);
    py.detach(|| {
        for (row, o) in rows.chunks_exact(xs[1]).zip(outs.chunks_exact_mut(xs[1])) {
            resin_kernels::softmax::softmax(row, lanes, o);
        }
    });
    Ok(())
}

/// The token of each sample `i` drawn from row `rows[i]` of `logits` [R, V] (f32,
/// C-contiguous, read in place) with its `temperature`, `top_k`, `top_p`, `min_p`,
/// `log_min_p` (torch's `log(clamp(min_p, 0))`) and `uniforms` (each [n]), into `tokens` [n]
/// (int64): the tokens of `resin/sampling_draw.py`'s `draw_tokens`, bit for bit where `lanes`
/// is torch's float vector width (`resin-kernels`' `sampling`); -1 for a sample left to the
/// caller (a setting or row the kernel does not take). GIL released; the samples dealt out
/// over `threads` threads of torch's OpenMP team, every `threads`-th to one (each sample's
/// token is its own: the split changes no token). `bounded=False` turns off the bounded
/// decisions (`resin-kernels`' `bounded_draw` and the top-p cut from `cheap_exp`'s bounds;
/// the same tokens, for A/B runs).
#[pyfunction]
#[pyo3(signature = (logits, rows, temperature, top_k, top_p, min_p, log_min_p, uniforms, lanes, tokens, *, threads=1, bounded=true))]
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    rows: PyReadonlyArray1<'_, i64>,
    temperature: PyReadonlyArray1<'_, f32>,
    top_k: PyReadonlyArray1<'_, i64>,
    top_p: PyReadonlyArray1<'_, f32>,
    min_p: PyReadonlyArray1<'_, f32>,
    log_min_p: PyReadonlyArray1<'_, f32>,
    uniforms: PyReadonlyArray1<'_, f32>,
    lanes: usize,
    mut tokens: PyReadwriteArray1<'_, i64>,
    threads: usize,
    bounded: bool,
) -> PyResult<()> {
    let bad = |what: String| Err(PyValueError::new_err(format!("sample_rows: {what}")));
    let Some(lanes) = resin_kernels::softmax::Lanes::new(lanes) else {
        return bad(format!("lanes must be 8 or 16, not {lanes}"));
    };
    let ls = logits.shape().to_vec();
    let n = rows.len();
    let lengths = [temperature.len(), top_k.len(), top_p.len(), min_p.len(), log_min_p.len(), uniforms.len(), tokens.len()];
    if ls[1] == 0 || ls[1] >= 1 << 32 || lengths.iter().any(|&len| len != n) {
        return bad(format!(
            "logits {ls:?} and rows [{n}], temperature, top_k, top_p, min_p, log_min_p, uniforms, tokens {lengths:?} \
             do not agree ([R, 0 < V < 2^32], each [n])"
        ));
    }
    c_order("sample_rows", [("logits", logits.is_c_contiguous()), ("tokens", tokens.is_c_contiguous())])?;
    let not_c = |_| PyValueError::new_err("sample_rows: arrays must be contiguous and aligned");
    let row_list = rows.as_slice().map_err(not_c)?;
    if let Some(&row) = row_list.iter().find(|&&r| r < 0 || r as usize >= ls[0]) {
        return bad(format!("row {row} is not a row of logits {ls:?}"));
    }
    let inputs = [
        byte_extent(logits.data(), &ls, logits.strides()),
        byte_extent(rows.data(), &[n], rows.strides()),
        byte_extent(temperature.data(), &[n], temperature.strides()),
        byte_extent(top_k.data(), &[n], top_k.strides()),
        byte_extent(top_p.data(), &[n], top_p.strides()),
        byte_extent(min_p.data(), &[n], min_p.strides()),
        byte_extent(log_min_p.data(), &[n], log_min_p.strides()),
        byte_extent(uniforms.data(), &[n], uniforms.strides()),
    ];
    if shares_bytes(byte_extent(tokens.data(), &[n], tokens.strides()), inputs) {
        return bad("tokens must not overlap an input".to_string());
    }
    let settings: Vec<resin_kernels::sampling::Settings> = {
        let (t, k, p) =
            (temperature.as_slice().map_err(not_c)?, top_k.as_slice().map_err(not_c)?, top_p.as_slice().map_err(not_c)?);
        let (m, lm, u) =
            (min_p.as_slice().map_err(not_c)?, log_min_p.as_slice().map_err(not_c)?, uniforms.as_slice().map_err(not_c)?);
        (0..n)
            .map(|i| resin_kernels::sampling::Settings {
                temperature: t[i],
                top_k: k[i],
                top_p: p[i],
                min_p: m[i],
                log_min_p: lm[i],
                uniform: u[i],
            })
            .collect()
    };
    let all = logits.as_slice().map_err(not_c)?;
    let out = tokens.as_slice_mut().map_err(not_c)?;
    let vocab_size = ls[1];
    let drawn = py.detach(|| {
        on_row_threads(n, threads, &|mine| {
            let row = |i: usize| {
                let r = row_list[mine[i]] as usize;
                &all[r * vocab_size..(r + 1) * vocab_size]
            };
            let own: Vec<_> = mine.iter().map(|&i| settings[i]).collect();
            let drawn = resin_kernels::sampling::sample_rows(row, &own, lanes, &mut Default::default(), bounded);
            drawn.into_iter().map(|d| d.map_or(-1, |t| t as i64)).collect()
        })
    });
    let Some(drawn) = drawn else {
        return bad("the kernel panicked on a thread".to_string());
    };
    out.copy_from_slice(&drawn);
    Ok(())
}
