//! `--plot`: the training loss per logged step and the held-out loss per evaluation as line
//! charts, to SVG or PNG by the path's extension (plotters; text in a bundled subset of DejaVu
//! Sans, so no system font library is needed). Written under a temporary name, then renamed.

use std::path::Path;
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

/// Draws `curves` to `path` (`.svg` or `.png`).
pub fn render(path: &Path, curves: &Curves<'_>) -> Result<(), TrainError> {
    register_font().map_err(|e| plot_err(path, e))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| plot_err(path, "no file name".into()))?;
    let tmp = path.with_file_name(format!(".{name}.partial.{ext}"));
    let drawn = match ext {
        "svg" => draw(SVGBackend::new(&tmp, SIZE).into_drawing_area(), curves),
        "png" => draw(BitMapBackend::new(&tmp, SIZE).into_drawing_area(), curves),
        _ => Err(format!("{ext:?} is not svg or png")),
    };
    if let Err(e) = drawn {
        let _ = std::fs::remove_file(&tmp);
        return Err(plot_err(path, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| plot_err(path, e.to_string()))
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
