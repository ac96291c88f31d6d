//! `--plot`: the training loss per step and the held-out loss per evaluation as line charts,
//! to SVG or PNG by the path's extension (plotters; text in a bundled subset of DejaVu Sans, so
//! no system font library is needed; PNG encoded by `png`). The file names the run that drew
//! it (an SVG comment, a PNG text chunk; `run_of` reads it back). Written under a temporary
//! name, never through a symlink, then renamed.

use std::io::{BufReader, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::error::TrainError;

/// The printable ASCII glyphs of DejaVu Sans (license in `assets/DejaVuSans-ascii.LICENSE`).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans-ascii.ttf");
const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 540);

fn plot_err(path: &Path, detail: String) -> TrainError {
    TrainError::Output {
        what: "--plot",
        path: path.to_path_buf(),
        detail,
    }
}

fn register_font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(FAMILY, FontStyle::Normal, FONT)
            .map_err(|_| "the bundled font does not load".to_string())
    })
    .clone()
}

/// The curves to draw: (step, loss) points.
pub struct Curves<'a> {
    pub title: &'a str,
    pub train: &'a [(u64, f64)],
    pub heldout: &'a [(u64, f64)],
}

/// The SVG comment and PNG text keyword that name the run.
const RUN_MARK: &str = "oxiflow-run";

/// The temporary file a plot at `path` is written to before it is renamed into place.
pub fn partial_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "plot".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.partial"))
}

/// Draws `curves` to `path` (`.svg` or `.png`), naming run `run_id` in the file.
pub fn render(path: &Path, curves: &Curves<'_>, run_id: &str) -> Result<(), TrainError> {
    register_font().map_err(|e| plot_err(path, e))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let bytes = match ext {
        "svg" => svg(curves, run_id),
        "png" => png(curves, run_id),
        _ => Err(format!("{ext:?} is not svg or png")),
    }
    .map_err(|e| plot_err(path, e))?;
    let tmp = partial_path(path);
    let written = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(plot_err(path, e.to_string()));
    }
    Ok(())
}

fn svg(curves: &Curves<'_>, run_id: &str) -> Result<Vec<u8>, String> {
    let mut text = String::new();
    draw(
        SVGBackend::with_string(&mut text, SIZE).into_drawing_area(),
        curves,
    )?;
    // The run's mark right after the root element's opening tag.
    let at = text
        .find("<svg")
        .and_then(|s| text[s..].find('>').map(|e| s + e + 1));
    let at = at.ok_or("the drawn SVG has no root element")?;
    text.insert_str(at, &format!("\n<!-- {RUN_MARK} {run_id} -->"));
    Ok(text.into_bytes())
}

fn png(curves: &Curves<'_>, run_id: &str) -> Result<Vec<u8>, String> {
    let (w, h) = SIZE;
    let mut rgb = vec![0u8; (w * h * 3) as usize];
    draw(
        BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area(),
        curves,
    )?;
    let mut out = Vec::new();
    let mut enc = ::png::Encoder::new(&mut out, w, h);
    enc.set_color(::png::ColorType::Rgb);
    enc.set_depth(::png::BitDepth::Eight);
    enc.add_text_chunk(RUN_MARK.into(), run_id.into())
        .map_err(|e| e.to_string())?;
    let mut writer = enc.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(&rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(out)
}

/// The run that drew the plot at `path` (None: not a plot of a run, e.g. another program's).
pub fn run_of(path: &Path) -> Result<Option<String>, TrainError> {
    let file = std::fs::File::open(path).map_err(|e| plot_err(path, e.to_string()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext == "png" {
        let mut decoder = ::png::Decoder::new(BufReader::new(file));
        decoder.set_ignore_text_chunk(false);
        let Ok(reader) = decoder.read_info() else {
            return Ok(None);
        };
        return Ok(reader
            .info()
            .uncompressed_latin1_text
            .iter()
            .find(|t| t.keyword == RUN_MARK)
            .map(|t| t.text.clone()));
    }
    let mut head = Vec::new();
    file.take(4096)
        .read_to_end(&mut head)
        .map_err(|e| plot_err(path, e.to_string()))?;
    let head = String::from_utf8_lossy(&head);
    let mark = format!("<!-- {RUN_MARK} ");
    Ok(head.find(&mark).and_then(|at| {
        let rest = &head[at + mark.len()..];
        rest.find(" -->").map(|end| rest[..end].to_string())
    }))
}

/// The range `lo..hi` widened by 5% (and to a non-empty one).
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    let pad = ((hi - lo) * 0.05).max(1e-3 * hi.abs().max(1.0));
    (lo - pad, hi + pad)
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Curves<'_>) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let points = c.train.iter().chain(c.heldout).filter(|p| p.1.is_finite());
    let (mut x0, mut x1, mut y0, mut y1) = (u64::MAX, 0u64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in points {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return Err("no finite loss to draw".into());
    }
    let (y0, y1) = padded(y0, y1);
    let x1 = x1.max(x0 + 1);
    let mut chart = ChartBuilder::on(&root)
        .caption(c.title, (FAMILY, 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats)")
        .label_style((FAMILY, 15))
        .draw()
        .map_err(err)?;
    let series = [
        ("training loss", c.train, BLUE),
        ("held-out loss", c.heldout, RED),
    ];
    for (label, pts, color) in series {
        if pts.is_empty() {
            continue;
        }
        let line = pts.iter().filter(|p| p.1.is_finite()).copied();
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if pts.len() <= 64 {
            chart
                .draw_series(line.map(|p| Circle::new(p, 3, color.filled())))
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .label_font((FAMILY, 15))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}
